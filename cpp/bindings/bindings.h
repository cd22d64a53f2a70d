// The pybind11 module pyengine._C: conversion only, no logic. Each file binds one part
// of pyengine_core.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "pyengine/kv_group.h"

namespace pyengine::bindings {

// A CUDA stream handle as Python passes it (torch.cuda.Stream.cuda_stream; 0: the default
// stream), as the void* the kernels take.
inline void* as_stream(uintptr_t handle) { return reinterpret_cast<void*>(handle); }

// KV-cache groups as Python gives them: (kind, size) pairs, kind "full", "sliding" or
// "chunked" (an empty list: one full group).
inline std::vector<KVGroupSpec> kv_groups(const std::vector<std::pair<std::string, int>>& specs) {
  std::vector<KVGroupSpec> groups;
  for (const auto& [kind, size] : specs) groups.push_back({parse_kv_group_kind(kind), size});
  return groups;
}

void bind_errors(pybind11::module_& m);
void bind_prefix_hash(pybind11::module_& m);
void bind_kv_cache(pybind11::module_& m);
void bind_cache_ops(pybind11::module_& m);
void bind_scheduler(pybind11::module_& m);
void bind_attention(pybind11::module_& m);
void bind_layer_ops(pybind11::module_& m);
void bind_kernel_program(pybind11::module_& m);
void bind_recurrent(pybind11::module_& m);

}  // namespace pyengine::bindings
