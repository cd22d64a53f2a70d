// The CUDA fused-layer and cache-write kernels (launched by layer_kernels.cu), and the
// launch shapes they are written for. Arithmetic in float32 whatever the storage type:
// the norms' sums in float, each output rounded once. Every kernel moves W consecutive
// elements per access (Pack): 16 bytes where the launcher found the tensors aligned for
// it (with_pack_width), single elements otherwise (W = 1). Device code and plain C++
// only, so that cpp/tests can run the kernels on the host (cuda_host_emulation.h).
// Internal to cuda/.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "cuda/element_types.cuh"

namespace pyengine::cuda::layer_kernels {

constexpr int kMaxThreads = 1024;

// The sum of every thread's `value` in the block, returned to all threads. `shared`
// holds one float per warp.
__device__ inline float block_sum(float value, float* shared) {
  value = warp_sum(value);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  const int warps = (blockDim.x + kWarp - 1) / kWarp;
  return warp_sum(lane < warps ? shared[lane] : 0.0f);
}

// One block per row. out = weight * (x * inv), inv = 1 / sqrt(mean(x^2) + eps).
template <typename T, int W>
__global__ void __launch_bounds__(kMaxThreads)
    rms_norm_kernel(T* __restrict__ out, int64_t out_stride, const T* __restrict__ x,
                    int64_t x_stride, const T* __restrict__ weight, int n, float eps) {
  __shared__ float shared[kMaxThreads / kWarp];
  const T* row = x + blockIdx.x * x_stride;
  const int packs = n / W;
  float squares = 0.0f;
  for (int p = threadIdx.x; p < packs; p += blockDim.x) {
    const Pack<T, W> v = load_pack<T, W>(row + p * W);
#pragma unroll
    for (int j = 0; j < W; ++j) squares += to_float(v.v[j]) * to_float(v.v[j]);
  }
  const float inv = rsqrtf(block_sum(squares, shared) / static_cast<float>(n) + eps);
  T* dst = out + blockIdx.x * out_stride;
  for (int p = threadIdx.x; p < packs; p += blockDim.x) {
    const Pack<T, W> v = load_pack<T, W>(row + p * W), w = load_pack<T, W>(weight + p * W);
    Pack<T, W> o;
#pragma unroll
    for (int j = 0; j < W; ++j) o.v[j] = from_float<T>(to_float(w.v[j]) * (to_float(v.v[j]) * inv));
    store_pack<T, W>(dst + p * W, o);
  }
}

// One block per row: z = x + residual (float); residual = z; x = rms_norm(z) * weight.
// Each thread reads and writes the same elements in both passes, so the second pass
// recomputes z from the untouched inputs instead of keeping the row.
template <typename T, int W>
__global__ void __launch_bounds__(kMaxThreads)
    fused_add_rms_norm_kernel(T* __restrict__ x, int64_t x_stride, T* __restrict__ residual,
                              int64_t residual_stride, const T* __restrict__ weight, int n,
                              float eps) {
  __shared__ float shared[kMaxThreads / kWarp];
  T* xs = x + blockIdx.x * x_stride;
  T* res = residual + blockIdx.x * residual_stride;
  const int packs = n / W;
  float squares = 0.0f;
  for (int p = threadIdx.x; p < packs; p += blockDim.x) {
    const Pack<T, W> a = load_pack<T, W>(res + p * W), b = load_pack<T, W>(xs + p * W);
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float z = to_float(a.v[j]) + to_float(b.v[j]);
      squares += z * z;
    }
  }
  const float inv = rsqrtf(block_sum(squares, shared) / static_cast<float>(n) + eps);
  for (int p = threadIdx.x; p < packs; p += blockDim.x) {
    const Pack<T, W> a = load_pack<T, W>(res + p * W), b = load_pack<T, W>(xs + p * W);
    const Pack<T, W> w = load_pack<T, W>(weight + p * W);
    Pack<T, W> sum, normed;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float z = to_float(a.v[j]) + to_float(b.v[j]);
      sum.v[j] = from_float<T>(z);
      normed.v[j] = from_float<T>(to_float(w.v[j]) * (z * inv));
    }
    store_pack<T, W>(res + p * W, sum);
    store_pack<T, W>(xs + p * W, normed);
  }
}

// One block per token; threads over (head, W pairs) of query, then of key. Pair i of a
// head is (i, i + d/2) rotate-half, (2i, 2i + 1) interleaved; a thread takes pairs
// i0 .. i0 + W - 1, as two packs: [i0, i0 + W) and [d/2 + i0, ...) rotate-half, the
// 2W elements from 2 * i0 interleaved.
template <typename T, typename Position, int W>
__global__ void __launch_bounds__(kMaxThreads)
    rotary_kernel(const Position* __restrict__ positions, int64_t position_stride,
                  T* __restrict__ query, int64_t q_token_stride, int num_heads, T* __restrict__ key,
                  int64_t k_token_stride, int num_kv_heads, int d,
                  const float* __restrict__ cos_sin, int64_t cos_sin_stride, int64_t max_positions,
                  bool is_neox) {
  const int64_t token = blockIdx.x;
  const int64_t position = positions[token * position_stride];
  if (position < 0 || position >= max_positions) return;  // see layer_kernels_launch.h
  const float* cs = cos_sin + position * cos_sin_stride;
  const int half = d / 2;
  const int per_head = half / W;
  const int work = (num_heads + num_kv_heads) * per_head;
  for (int p = threadIdx.x; p < work; p += blockDim.x) {
    const int head = p / per_head, i0 = (p % per_head) * W;
    T* row = head < num_heads ? query + token * q_token_stride + head * d
                              : key + token * k_token_stride + (head - num_heads) * d;
    T* first = row + (is_neox ? i0 : 2 * i0);
    T* second = is_neox ? row + half + i0 : first + W;
    Pack<T, W> a = load_pack<T, W>(first), b = load_pack<T, W>(second);
    // e: the 2W elements in memory order of the interleaved form, or (a, b) rotate-half.
    float e[2 * W];
#pragma unroll
    for (int j = 0; j < W; ++j) {
      e[j] = to_float(a.v[j]);
      e[W + j] = to_float(b.v[j]);
    }
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const int x = is_neox ? k : 2 * k, y = is_neox ? W + k : 2 * k + 1;
      const float c = cs[i0 + k], s = cs[half + i0 + k];
      const float ex = e[x], ey = e[y];
      e[x] = ex * c + (-ey) * s;
      e[y] = ey * c + ex * s;
    }
#pragma unroll
    for (int j = 0; j < W; ++j) {
      a.v[j] = from_float<T>(e[j]);
      b.v[j] = from_float<T>(e[W + j]);
    }
    store_pack<T, W>(first, a);
    store_pack<T, W>(second, b);
  }
}

// Grid (rows, chunks of threads * W elements): out = gate / (1 + exp(-gate)) * up.
template <typename T, int W>
__global__ void __launch_bounds__(kMaxThreads)
    silu_and_mul_kernel(T* __restrict__ out, int64_t out_stride, const T* __restrict__ x,
                        int64_t x_stride, int64_t n) {
  const int64_t r = blockIdx.x;
  const int64_t i = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * W;
  if (i >= n) return;
  const T* in = x + r * x_stride;
  const Pack<T, W> gate = load_pack<T, W>(in + i), up = load_pack<T, W>(in + n + i);
  Pack<T, W> o;
#pragma unroll
  for (int j = 0; j < W; ++j) {
    const float g = to_float(gate.v[j]);
    o.v[j] = from_float<T>(g / (1.0f + expf(-g)) * to_float(up.v[j]));
  }
  store_pack<T, W>(out + r * out_stride + i, o);
}

// One block per token; threads over (kv head, W elements of d). Values go to their tile
// [block_size, d] as packs; keys to their transposed tile [d, block_size], one element
// at a time (a token's key elements lie block_size apart there).
template <typename T, int W>
__global__ void __launch_bounds__(kMaxThreads)
    reshape_and_cache_kernel(const T* __restrict__ key, int64_t key_token_stride,
                             int64_t key_head_stride, const T* __restrict__ value,
                             int64_t value_token_stride, int64_t value_head_stride,
                             T* __restrict__ key_cache, T* __restrict__ value_cache,
                             const int64_t* __restrict__ slots, int64_t slot_stride,
                             int num_kv_heads, int head_size, int block_size, int64_t num_slots) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slots[token * slot_stride];
  if (slot < 0 || slot >= num_slots) return;  // see layer_kernels_launch.h
  const int64_t block = slot / block_size, offset = slot % block_size;
  const int64_t tile = static_cast<int64_t>(block_size) * head_size;
  const int per_head = head_size / W;
  for (int p = threadIdx.x; p < num_kv_heads * per_head; p += blockDim.x) {
    const int head = p / per_head, i = (p % per_head) * W;
    const int64_t base = (block * num_kv_heads + head) * tile;
    const Pack<T, W> k =
        load_pack<T, W>(key + token * key_token_stride + head * key_head_stride + i);
    store_pack<T, W>(
        value_cache + base + offset * head_size + i,
        load_pack<T, W>(value + token * value_token_stride + head * value_head_stride + i));
#pragma unroll
    for (int j = 0; j < W; ++j)
      key_cache[base + static_cast<int64_t>(i + j) * block_size + offset] = k.v[j];
  }
}

// Threads for a block that walks `work` items: whole warps, at most kMaxThreads.
inline int threads_for(int64_t work) {
  const int64_t warps = (work + kWarp - 1) / kWarp;
  return static_cast<int>(std::min<int64_t>(kMaxThreads, std::max<int64_t>(1, warps) * kWarp));
}

// f(std::integral_constant<int, W>) with W = kPackWidth<T> where every pointer is 16-byte
// aligned and every count (sizes and strides, in elements) a multiple of W; else W = 1.
template <typename T, class F>
void with_pack_width(std::initializer_list<const void*> pointers,
                     std::initializer_list<int64_t> counts, F&& f) {
  constexpr int kWidth = kPackWidth<T>;
  bool fits = true;
  for (const void* p : pointers) fits = fits && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  for (const int64_t c : counts) fits = fits && c % kWidth == 0;
  if (fits) {
    f(std::integral_constant<int, kWidth>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

}  // namespace pyengine::cuda::layer_kernels
