// Multi-head latent attention (DeepSeek's MLA) in the absorbed form over a paged latent
// cache (launched by mla_attention.cu): every head of a query token attends to its
// request's cached latent vectors, each the key of every head (all latent_dim numbers)
// and, its first value_dim numbers, the value. A thread block per (query token, head,
// partition of the context), as the scalar paged-attention kernel's: four warps take 32
// keys at a time, a key per lane (the score: the query, from shared memory, times the
// key's latent row), keep an online softmax each, and add the weighted value rows with
// the value dims across lanes (kValuePerLane a lane). Long contexts of few tokens are
// split into partitions whose (max, sum, unnormalized output) the scalar kernel's
// finish_block writes and its merge_kernel merges, the params' head_size being the
// value's. The cache is the query's
// type T. Device code and plain C++ only, so that cpp/tests can run it on the host.
// Internal to cuda/.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/attention_params.cuh"
#include "cuda/element_types.cuh"
#include "cuda/paged_attention.cuh"

namespace pyengine::cuda::mla {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarp;
constexpr int kValuePerLane = 16;                 // value dims a lane: value_dim <= 512
constexpr int kMaxValue = kValuePerLane * kWarp;  // 512 (DeepSeek's kv_lora_rank)
constexpr int kMaxLatent = 1024;                  // latent_dim (DeepSeek's 576)
constexpr int kPartitionKeys = 512;               // of the longest context, per partition
constexpr int kMaxPartitions = 256;
constexpr int64_t kSplitBelowPairs = 4096;  // (token, head) pairs that fill the grid

// p: the scalar kernel's params with key_cache the latent cache [blocks, block_size,
// latent_dim], num_kv_heads 1 and head_size the value's dims; latent_dim the row's.
template <typename T>
__global__ void __launch_bounds__(kThreads) mla_kernel(const AttentionParams p, int latent_dim) {
  __shared__ float query[kMaxLatent];
  __shared__ float warp_max_[kWarps], warp_sum_[kWarps];
  __shared__ float warp_acc[kWarps][kMaxValue];

  const int token = blockIdx.x, head = blockIdx.y, part = blockIdx.z;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int d = latent_dim, v = p.head_size, bs = p.block_size;
  const int r = request_of(p.query_start_loc, p.num_reqs, token);
  const int64_t q_len = p.query_start_loc[r + 1] - p.query_start_loc[r];
  const int64_t position = p.seq_lens[r] - q_len + (token - p.query_start_loc[r]);
  const auto [begin, end] = partition_keys(0, position + 1, part, p.num_parts, kWarp);

  const T* q = static_cast<const T*>(p.query) + token * p.q_token_stride + head * p.q_head_stride;
  for (int i = threadIdx.x; i < d; i += kThreads) query[i] = to_float(q[i]) * p.scale;
  __syncthreads();

  const T* latents = static_cast<const T*>(p.key_cache);
  const int32_t* table = p.block_tables + static_cast<int64_t>(r) * p.max_blocks;
  const auto row_of = [&](int64_t key) {  // the key's latent row
    return (static_cast<int64_t>(cache_block(p, table[key / bs])) * bs + key % bs) * d;
  };

  float running_max = -INFINITY, running_sum = 0.0f;
  float acc[kValuePerLane] = {};
  for (int64_t chunk = begin + warp * kWarp; chunk < end; chunk += kWarps * kWarp) {
    const int64_t key = chunk + lane;
    const bool visible = key < end;
    float score = -INFINITY;
    int64_t row = 0;
    if (visible) {
      row = row_of(key);
      float dot = 0.0f;
      for (int i = 0; i < d; ++i) dot += query[i] * to_float(latents[row + i]);
      score = dot;
    }
    const float new_max = fmaxf(running_max, warp_max(score));  // lane 0's key is visible
    const float correction = __expf(running_max - new_max);     // 0 on the first chunk
    const float weight = visible ? __expf(score - new_max) : 0.0f;
    running_sum = running_sum * correction + warp_sum(weight);
    for (int j = 0; j < kValuePerLane; ++j) acc[j] *= correction;
    const int count = static_cast<int>(min(static_cast<int64_t>(kWarp), end - chunk));
    for (int k = 0; k < count; ++k) {
      const float w = __shfl_sync(0xffffffffu, weight, k);
      const int64_t key_row = __shfl_sync(0xffffffffu, row, k);
      for (int j = 0; j < kValuePerLane; ++j) {
        const int dim = j * kWarp + lane;
        if (dim < v) acc[j] += w * to_float(latents[key_row + dim]);
      }
    }
    running_max = new_max;
  }

  if (lane == 0) {
    warp_max_[warp] = running_max;
    warp_sum_[warp] = running_sum;
  }
  for (int j = 0; j < kValuePerLane; ++j) {
    if (j * kWarp + lane < v) warp_acc[warp][j * kWarp + lane] = acc[j];
  }
  __syncthreads();

  scalar_attention::finish_block<T, kWarps>(p, token, head, part, v, &warp_acc[0][0],
                                            kMaxValue, warp_max_, warp_sum_);
}

}  // namespace pyengine::cuda::mla
