// What the two CUDA paged-attention kernels share: their parameters, the request a query
// token belongs to, and how a token's visible keys are split into partitions (split-K).
// paged_attention.cuh holds the scalar kernel (any supported dtype and head size) and the
// partitions' merge, flash_attention.cuh the tensor-core kernel for 16-bit types, and
// paged_attention.cu the dispatch. Internal to cuda/.
#pragma once

#include <cstdint>

namespace pyengine::cuda {

// A partition of a split context takes at least this many keys.
constexpr int kMinPartitionKeys = 256;

struct AttentionParams {
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  void* out;
  float* partials;  // [tokens, heads, num_parts, head_size + 2] when num_parts > 1
  int64_t q_token_stride, q_head_stride, o_token_stride, o_head_stride;
  int64_t max_blocks, num_blocks;
  int num_reqs, num_heads, num_kv_heads, head_size, block_size, num_parts;
  int tiles_per_request;  // flash kernel: grid.x is num_reqs * tiles_per_request
  int block_shift;        // flash kernel: log2(block_size)
  float scale;
  int sliding_window;
  int attention_chunk;  // > 0: a query at p sees keys from p - p % chunk on
  float logit_soft_cap;
  const float* sinks;  // float32 [num_heads]: each head's sink logit (gpt-oss's); or null
};

// A row's softmax denominator `sum` over its keys (their max `max`, natural-log units),
// with its head's sink where the heads have sinks.
__device__ inline float with_sink(const AttentionParams& p, int head, float sum, float max) {
  return p.sinks == nullptr ? sum : sum + __expf(p.sinks[head] - max);
}

// The first position a query at `position` sees (its window's, its chunk's); the blocks
// before it are never read (a window's KV-cache group may have released them).
__device__ inline int64_t first_visible(const AttentionParams& p, int64_t position) {
  int64_t first = p.sliding_window > 0 ? position - p.sliding_window + 1 : 0;
  if (p.attention_chunk > 0) first = max(first, position - position % p.attention_chunk);
  return max(first, int64_t{0});
}

// The request whose query tokens include `token`: the r with qsl[r] <= token < qsl[r + 1]
// (requests without query tokens have qsl[r] == qsl[r + 1] and are never it).
__device__ inline int request_of(const int32_t* qsl, int num_reqs, int token) {
  int lo = 0, hi = num_reqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (qsl[mid] <= token) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

struct KeyRange {
  int64_t begin, end;
};

// Partition `part`'s share of the visible keys [first, end): num_parts even shares, each
// a whole number of `align` keys and at least kMinPartitionKeys; the last share takes the
// rest, however long (num_parts comes from the max_seq_len hint). Shares may be empty.
__device__ inline KeyRange partition_keys(int64_t first, int64_t end, int part, int num_parts,
                                          int align) {
  if (num_parts == 1) return {first, end};
  const int64_t share = (end - first + num_parts - 1) / num_parts;
  const int64_t keys =
      share < kMinPartitionKeys ? kMinPartitionKeys : (share + align - 1) / align * align;
  const int64_t begin = first + part * keys;
  return {begin, part + 1 < num_parts ? (end < begin + keys ? end : begin + keys) : end};
}

// A block-table entry as a block id, ids outside the cache read as block 0 (see
// paged_attention_launch.h): never out of bounds, whatever the table holds past a request's end.
__device__ inline int32_t cache_block(const AttentionParams& p, int32_t entry) {
  return entry < 0 || entry >= p.num_blocks ? 0 : entry;
}

}  // namespace pyengine::cuda
