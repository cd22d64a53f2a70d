// The scalar paged-attention kernel and the merge of split contexts (launched by
// paged_attention.cu, which also dispatches to the tensor-core kernel). A thread block per
// (query token, query head, partition of the context), whose four warps take 32 keys at a
// time, a key per lane (the score: the query, from shared memory, times the key's column
// of the transposed key tile, which neighbouring lanes read contiguously), keep an online
// softmax each, and add the weighted value rows with the head dimension across lanes.
// Long contexts of few tokens (decode) are split: one partition per kPartitionKeys keys
// of the longest context, each token's context shared evenly among them
// (attention_params.cuh), each written as (max, sum, unnormalized output), which
// merge_kernel merges ("v2"). The cache's elements C are the query's type T, or 8-bit
// (cache_8bit.cuh: fp8 e4m3, or int8 whose key scale multiplies the score and whose value
// scale the softmax weight). Device code and plain C++ only, so that cpp/tests can run
// them on the host. Internal to cuda/.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/attention_params.cuh"
#include "cuda/cache_8bit.cuh"
#include "cuda/element_types.cuh"

namespace pyengine::cuda::scalar_attention {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarp;
constexpr int kPartitionKeys = 512;  // of the longest context, per partition
constexpr int kMaxPartitions = 256;
// Above this many (token, head) pairs the grid is full without splitting contexts.
constexpr int64_t kSplitBelowPairs = 4096;

using Params = AttentionParams;

// The block's warps' online softmaxes (each its max, sum and unnormalised output of `d`
// dims, warp w's at warp_acc + w * stride) combined: the output where the context is
// whole, else this partition's (max, sum, output) for merge_kernel. Every thread of the
// block calls it.
template <typename T, int kBlockWarps>
__device__ void finish_block(const Params& p, int token, int head, int part, int d,
                             const float* warp_acc, int stride, const float* warp_max,
                             const float* warp_sum) {
  float block_max = -INFINITY;
  for (int w = 0; w < kBlockWarps; ++w) block_max = fmaxf(block_max, warp_max[w]);
  float scales[kBlockWarps];
  float sum = 0.0f;
  for (int w = 0; w < kBlockWarps; ++w) {
    scales[w] = block_max == -INFINITY ? 0.0f : __expf(warp_max[w] - block_max);
    sum += warp_sum[w] * scales[w];
  }
  const auto combined = [&](int i) {
    float total = 0.0f;
    for (int w = 0; w < kBlockWarps; ++w) total += warp_acc[w * stride + i] * scales[w];
    return total;
  };
  if (p.num_parts == 1) {
    T* o = static_cast<T*>(p.out) + token * p.o_token_stride + head * p.o_head_stride;
    const float denominator = with_sink(p, head, sum, block_max);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
      o[i] = from_float<T>(combined(i) / denominator);
    }
    return;
  }
  float* partial =
      p.partials +
      ((static_cast<int64_t>(token) * p.num_heads + head) * p.num_parts + part) * (d + 2);
  if (threadIdx.x == 0) {
    partial[0] = block_max;
    partial[1] = sum;
  }
  for (int i = threadIdx.x; i < d; i += blockDim.x) partial[2 + i] = combined(i);
}

template <typename T, typename C, int kDimsPerLane>
__global__ void __launch_bounds__(kThreads) attention_kernel(const Params p) {
  constexpr int kPad = kCachePad<C>;
  constexpr int kMaxDims = kDimsPerLane * kWarp;
  __shared__ float query[kMaxDims];
  __shared__ float warp_max_[kWarps], warp_sum_[kWarps];
  __shared__ float warp_acc[kWarps][kMaxDims];

  const int token = blockIdx.x, head = blockIdx.y, part = blockIdx.z;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int d = p.head_size, bs = p.block_size;
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const int r = request_of(p.query_start_loc, p.num_reqs, token);
  const int64_t q_len = p.query_start_loc[r + 1] - p.query_start_loc[r];
  const int64_t position = p.seq_lens[r] - q_len + (token - p.query_start_loc[r]);
  const int64_t first = first_visible(p, position);
  // This partition's share of the token's visible keys [first, position].
  const auto [begin, end] = partition_keys(first, position + 1, part, p.num_parts, kWarp);

  const T* q = static_cast<const T*>(p.query) + token * p.q_token_stride + head * p.q_head_stride;
  for (int i = threadIdx.x; i < d; i += kThreads) query[i] = to_float(q[i]) * p.scale;
  __syncthreads();

  const C* keys = static_cast<const C*>(p.key_cache);
  const C* values = static_cast<const C*>(p.value_cache);
  const int32_t* table = p.block_tables + static_cast<int64_t>(r) * p.max_blocks;
  const int64_t tile = static_cast<int64_t>(bs) * (d + kPad);
  const auto tile_base = [&](int64_t key) {  // the key's (block, kv head) tile
    const int64_t block = cache_block(p, table[key / bs]);
    return (block * p.num_kv_heads + kv_head) * tile;
  };

  float running_max = -INFINITY, running_sum = 0.0f;
  float acc[kDimsPerLane] = {};
  for (int64_t chunk = begin + warp * kWarp; chunk < end; chunk += kWarps * kWarp) {
    const int64_t key = chunk + lane;
    const bool visible = key < end;
    float score = -INFINITY, value_scale = 1.0f;
    int64_t value_row = 0;
    if (visible) {
      const int64_t base = tile_base(key), offset = key % bs;
      const C* column = keys + base + offset;
      float dot = 0.0f;
      for (int i = 0; i < d; ++i) dot += query[i] * to_float(column[static_cast<int64_t>(i) * bs]);
      value_row = base + offset * (d + kPad);
      if constexpr (kPad > 0) {
        dot *= scale_at(keys + base + static_cast<int64_t>(d) * bs + offset * kPad);
        value_scale = scale_at(values + value_row + d);
      }
      score = p.logit_soft_cap > 0 ? p.logit_soft_cap * tanhf(dot / p.logit_soft_cap) : dot;
    }
    const float new_max = fmaxf(running_max, warp_max(score));  // lane 0's key is visible
    const float correction = __expf(running_max - new_max);     // 0 on the first chunk
    const float weight = visible ? __expf(score - new_max) : 0.0f;
    running_sum = running_sum * correction + warp_sum(weight);
    for (int j = 0; j < kDimsPerLane; ++j) acc[j] *= correction;
    const float scaled_weight = weight * value_scale;
    const int count = static_cast<int>(min(static_cast<int64_t>(kWarp), end - chunk));
    for (int k = 0; k < count; ++k) {
      const float w = __shfl_sync(0xffffffffu, scaled_weight, k);
      const int64_t row = __shfl_sync(0xffffffffu, value_row, k);
      for (int j = 0; j < kDimsPerLane; ++j) {
        const int dim = j * kWarp + lane;
        if (dim < d) acc[j] += w * to_float(values[row + dim]);
      }
    }
    running_max = new_max;
  }

  if (lane == 0) {
    warp_max_[warp] = running_max;
    warp_sum_[warp] = running_sum;
  }
  for (int j = 0; j < kDimsPerLane; ++j) warp_acc[warp][j * kWarp + lane] = acc[j];
  __syncthreads();

  finish_block<T, kWarps>(p, token, head, part, d, &warp_acc[0][0], kMaxDims, warp_max_,
                          warp_sum_);
}

// One block per (token, head): merges the partitions' (max, sum, output).
template <typename T>
__global__ void __launch_bounds__(kThreads) merge_kernel(const Params p) {
  const int token = blockIdx.x, head = blockIdx.y, d = p.head_size;
  const float* parts =
      p.partials + (static_cast<int64_t>(token) * p.num_heads + head) * p.num_parts * (d + 2);
  float max = -INFINITY;
  for (int k = 0; k < p.num_parts; ++k) max = fmaxf(max, parts[k * (d + 2)]);
  float sum = 0.0f;
  for (int k = 0; k < p.num_parts; ++k) {
    const float* part = parts + k * (d + 2);
    sum += part[0] == -INFINITY ? 0.0f : part[1] * __expf(part[0] - max);
  }
  T* o = static_cast<T*>(p.out) + token * p.o_token_stride + head * p.o_head_stride;
  const float denominator = with_sink(p, head, sum, max);
  for (int i = threadIdx.x; i < d; i += kThreads) {
    float total = 0.0f;
    for (int k = 0; k < p.num_parts; ++k) {
      const float* part = parts + k * (d + 2);
      if (part[0] != -INFINITY) total += part[2 + i] * __expf(part[0] - max);
    }
    o[i] = from_float<T>(total / denominator);
  }
}

}  // namespace pyengine::cuda::scalar_attention
