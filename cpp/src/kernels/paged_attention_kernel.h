// The CPU paged-attention kernel's parameters (AttentionParams, named as the CUDA kernel's
// in cuda/attention_params.cuh), shared by the glue (paged_attention.cpp) and the kernel,
// which is compiled once per instruction set (paged_attention_kernel.inc) and picked at
// run time. Internal to pyengine_core.
#pragma once

#include <cstdint>
#include <span>

#include "pyengine/attention.h"

namespace pyengine::detail {

constexpr int kQueryTile = 8;  // query tokens per work item

struct AttentionParams {
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int64_t q_token_stride, q_head_stride;  // elements
  int64_t o_token_stride, o_head_stride;
  int64_t max_blocks;  // block_tables row length
  int64_t num_kv_heads, group, block_size, head_size;
  AttentionOptions options;
  // Split-K: partial results, each [kQueryTile * group rows] x (max, sum, head_size
  // unnormalized outputs), partial_stride floats apart.
  float* partials;
  int64_t partial_stride;
};

// A tile of one request's query tokens times the query heads of one kv head: the rows
// that read the same K/V.
struct Tile {
  int32_t request;
  int32_t kv_head;
  int32_t first_query;  // within the request
  int32_t num_queries;
};

// One unit of parallel work: a tile over the key blocks [block_begin, block_end) of its
// request. Writes `out` (partial < 0) or, split across the context, its partial result.
struct WorkItem {
  Tile tile;
  int32_t block_begin, block_end;
  int32_t partial;
};

// A tile split across the context: partials [first_partial, first_partial + count) are
// merged into its output.
struct SplitTile {
  Tile tile;
  int32_t first_partial, count;
};

// query_dtype (of query and out) equals cache_dtype, or is float32 over a float16 or
// bfloat16 cache.
using AttentionKernel = void (*)(const AttentionParams&, std::span<const WorkItem>,
                                 std::span<const SplitTile>, DType query_dtype, DType cache_dtype);

// One build of the kernel per instruction set; each exists only where it was compiled.
#define PYENGINE_DECLARE_KERNEL(ns)                                                            \
  namespace ns {                                                                               \
  void run_attention(const AttentionParams& p, std::span<const WorkItem> items,                \
                     std::span<const SplitTile> splits, DType query_dtype, DType cache_dtype); \
  }
PYENGINE_DECLARE_KERNEL(generic)
PYENGINE_DECLARE_KERNEL(avx2)
PYENGINE_DECLARE_KERNEL(avx512)
#undef PYENGINE_DECLARE_KERNEL

}  // namespace pyengine::detail
