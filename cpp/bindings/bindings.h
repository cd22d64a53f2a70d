// The pybind11 module pyengine._C: conversion only, no logic. Each file binds one part
// of pyengine_core.
#pragma once

#include <pybind11/pybind11.h>

namespace pyengine::bindings {

void bind_errors(pybind11::module_& m);
void bind_prefix_hash(pybind11::module_& m);
void bind_kv_cache(pybind11::module_& m);
void bind_cache_ops(pybind11::module_& m);
void bind_scheduler(pybind11::module_& m);
void bind_attention(pybind11::module_& m);
void bind_layer_ops(pybind11::module_& m);

}  // namespace pyengine::bindings
