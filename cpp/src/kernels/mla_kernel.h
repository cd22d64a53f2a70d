// The portable MLA kernel's work item and entry point, built once per instruction set
// (mla_kernel.inc) and picked at run time by mla_attention.cpp.
#pragma once

#include <cstdint>

#include "pyengine/tensor_view.h"

namespace pyengine::detail {

struct MlaItem {
  int64_t token, position;  // the query token, and its position in its request
  int64_t request;
  int64_t begin, end;  // its keys, [begin, end)
  int64_t partial;     // where its partial result goes (-1: the output itself)
};

struct MlaShapes {
  int64_t heads, latent, value, block_size, max_blocks;
};

// One item: every head's softmax over the item's keys (the queries q [heads, latent]
// float32, already widened), into `acc` [heads, value] (and `max`, `sum` [heads]),
// unnormalised.
using MlaAttend = void (*)(const MlaItem& w, const MlaShapes& s, const float* q,
                           const void* cache, DType cache_dtype, const int32_t* table,
                           float scale, float* acc, float* max, float* sum);

#define PYENGINE_MLA_BUILD(ns)                                                               \
  namespace ns {                                                                             \
  void mla_attend(const MlaItem& w, const MlaShapes& s, const float* q, const void* cache,  \
                  DType cache_dtype, const int32_t* table, float scale, float* acc,          \
                  float* max, float* sum);                                                   \
  void mla_widen(const void* row, DType dtype, int64_t n, float* out);                       \
  }
PYENGINE_MLA_BUILD(generic)
PYENGINE_MLA_BUILD(avx2)
PYENGINE_MLA_BUILD(avx512)
#undef PYENGINE_MLA_BUILD

}  // namespace pyengine::detail
