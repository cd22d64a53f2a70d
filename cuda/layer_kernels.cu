// CUDA fused layers and the KV-cache write (see layer_kernels.h). Arithmetic in float32
// whatever the storage type: the norms' sums in float, each output rounded once. One
// kernel template per op, instantiated for float, half and bfloat16.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "cuda_utils.h"
#include "element_types.cuh"
#include "layer_kernels.h"

namespace pyengine::cuda {
namespace {

constexpr int kMaxThreads = 1024;

// The sum of every thread's `value` in the block, returned to all threads. `shared`
// holds one float per warp.
__device__ float block_sum(float value, float* shared) {
  value = warp_sum(value);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  const int warps = (blockDim.x + kWarp - 1) / kWarp;
  return warp_sum(lane < warps ? shared[lane] : 0.0f);
}

// One block per row. out = weight * (x * inv), inv = 1 / sqrt(mean(x^2) + eps).
template <typename T>
__global__ void rms_norm_kernel(T* __restrict__ out, int64_t out_stride, const T* __restrict__ x,
                                int64_t x_stride, const T* __restrict__ weight, int n, float eps) {
  __shared__ float shared[kMaxThreads / kWarp];
  const T* row = x + blockIdx.x * x_stride;
  float squares = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = to_float(row[i]);
    squares += v * v;
  }
  const float inv = rsqrtf(block_sum(squares, shared) / static_cast<float>(n) + eps);
  T* dst = out + blockIdx.x * out_stride;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    dst[i] = from_float<T>(to_float(weight[i]) * (to_float(row[i]) * inv));
  }
}

// One block per row: z = x + residual (float); residual = z; x = rms_norm(z) * weight.
// Each thread reads and writes the same elements in both passes, so the second pass
// recomputes z from the untouched inputs instead of keeping the row.
template <typename T>
__global__ void fused_add_rms_norm_kernel(T* __restrict__ x, int64_t x_stride,
                                          T* __restrict__ residual, int64_t residual_stride,
                                          const T* __restrict__ weight, int n, float eps) {
  __shared__ float shared[kMaxThreads / kWarp];
  T* xs = x + blockIdx.x * x_stride;
  T* res = residual + blockIdx.x * residual_stride;
  float squares = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float z = to_float(res[i]) + to_float(xs[i]);
    squares += z * z;
  }
  const float inv = rsqrtf(block_sum(squares, shared) / static_cast<float>(n) + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float z = to_float(res[i]) + to_float(xs[i]);
    res[i] = from_float<T>(z);
    xs[i] = from_float<T>(to_float(weight[i]) * (z * inv));
  }
}

// One block per token; threads over (head, i < d/2) pairs of query, then of key: (i,
// i + d/2) rotate-half, (2i, 2i + 1) interleaved.
template <typename T, typename Position>
__global__ void rotary_kernel(const Position* __restrict__ positions, int64_t position_stride,
                              T* __restrict__ query, int64_t q_token_stride, int q_heads,
                              T* __restrict__ key, int64_t k_token_stride, int k_heads, int d,
                              const float* __restrict__ cos_sin, int64_t cos_sin_stride,
                              int64_t max_positions, bool is_neox) {
  const int64_t token = blockIdx.x;
  const int64_t position = positions[token * position_stride];
  if (position < 0 || position >= max_positions) return;  // see layer_kernels.h
  const float* cs = cos_sin + position * cos_sin_stride;
  const int half = d / 2;
  const int pairs = (q_heads + k_heads) * half;
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int head = p / half, i = p % half;
    T* row = head < q_heads ? query + token * q_token_stride + head * d
                            : key + token * k_token_stride + (head - q_heads) * d;
    const int j = is_neox ? i : 2 * i, k = is_neox ? half + i : 2 * i + 1;
    const float a = to_float(row[j]), b = to_float(row[k]);
    const float c = cs[i], s = cs[half + i];
    row[j] = from_float<T>(a * c + (-b) * s);
    row[k] = from_float<T>(b * c + a * s);
  }
}

// Grid-stride over [rows, n]: out = gate / (1 + exp(-gate)) * up.
template <typename T>
__global__ void silu_and_mul_kernel(T* __restrict__ out, int64_t out_stride,
                                    const T* __restrict__ x, int64_t x_stride, int64_t rows,
                                    int64_t n) {
  const int64_t total = rows * n;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / n, i = e % n;
    const float gate = to_float(x[r * x_stride + i]);
    const float up = to_float(x[r * x_stride + n + i]);
    out[r * out_stride + i] = from_float<T>(gate / (1.0f + expf(-gate)) * up);
  }
}

// One block per token; threads over (kv head, i < d). Keys go to their transposed tile
// [d, block_size], values to [block_size, d].
template <typename T>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, int64_t key_token_stride,
                                         int64_t key_head_stride, const T* __restrict__ value,
                                         int64_t value_token_stride, int64_t value_head_stride,
                                         T* __restrict__ key_cache, T* __restrict__ value_cache,
                                         const int64_t* __restrict__ slots, int64_t slot_stride,
                                         int kv_heads, int d, int block_size, int64_t num_slots) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slots[token * slot_stride];
  if (slot < 0 || slot >= num_slots) return;  // see layer_kernels.h
  const int64_t block = slot / block_size, offset = slot % block_size;
  const int64_t tile = static_cast<int64_t>(block_size) * d;
  for (int e = threadIdx.x; e < kv_heads * d; e += blockDim.x) {
    const int head = e / d, i = e % d;
    const int64_t base = (block * kv_heads + head) * tile;
    key_cache[base + static_cast<int64_t>(i) * block_size + offset] =
        key[token * key_token_stride + head * key_head_stride + i];
    value_cache[base + offset * d + i] =
        value[token * value_token_stride + head * value_head_stride + i];
  }
}

void check_launch(const char* op) { check_cuda(op, cudaGetLastError(), "kernel launch"); }

// Threads for a block that walks `work` items: whole warps, at most kMaxThreads.
int threads_for(int64_t work) {
  const int64_t warps = (work + kWarp - 1) / kWarp;
  return static_cast<int>(std::min<int64_t>(kMaxThreads, std::max<int64_t>(1, warps) * kWarp));
}

template <typename T>
T* typed(const TensorView& t) {
  return static_cast<T*>(t.data);
}

}  // namespace

void rms_norm(const TensorView& out, const TensorView& x, const TensorView& weight, float eps,
              void* stream) {
  const int64_t rows = x.shape[0];
  const int n = static_cast<int>(x.shape[1]);
  if (rows == 0) return;
  const DeviceGuard guard(x.device.index);
  for_dtype(x.dtype, "rms_norm", [&](auto zero) {
    using T = decltype(zero);
    rms_norm_kernel<T>
        <<<static_cast<unsigned>(rows), threads_for(n), 0, static_cast<cudaStream_t>(stream)>>>(
            typed<T>(out), out.strides[0], typed<T>(x), x.strides[0], typed<T>(weight), n, eps);
  });
  check_launch("rms_norm");
}

void fused_add_rms_norm(const TensorView& x, const TensorView& residual, const TensorView& weight,
                        float eps, void* stream) {
  const int64_t rows = x.shape[0];
  const int n = static_cast<int>(x.shape[1]);
  if (rows == 0) return;
  const DeviceGuard guard(x.device.index);
  for_dtype(x.dtype, "fused_add_rms_norm", [&](auto zero) {
    using T = decltype(zero);
    fused_add_rms_norm_kernel<T>
        <<<static_cast<unsigned>(rows), threads_for(n), 0, static_cast<cudaStream_t>(stream)>>>(
            typed<T>(x), x.strides[0], typed<T>(residual), residual.strides[0], typed<T>(weight), n,
            eps);
  });
  check_launch("fused_add_rms_norm");
}

void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView& cos_sin_cache, bool is_neox, void* stream) {
  const int64_t tokens = query.shape[0];
  if (tokens == 0) return;
  const int q_heads = static_cast<int>(query.shape[1]), k_heads = static_cast<int>(key.shape[1]);
  const int d = static_cast<int>(query.shape[2]);
  const DeviceGuard guard(query.device.index);
  for_dtype(query.dtype, "rotary_embedding", [&](auto zero) {
    using T = decltype(zero);
    const auto launch = [&](const auto* pos) {
      rotary_kernel<<<static_cast<unsigned>(tokens), threads_for((q_heads + k_heads) * d / 2), 0,
                      static_cast<cudaStream_t>(stream)>>>(
          pos, positions.strides[0], typed<T>(query), query.strides[0], q_heads, typed<T>(key),
          key.strides[0], k_heads, d, static_cast<const float*>(cos_sin_cache.data),
          cos_sin_cache.strides[0], cos_sin_cache.shape[0], is_neox);
    };
    if (positions.dtype == DType::kInt32) {
      launch(static_cast<const int32_t*>(positions.data));
    } else {
      launch(static_cast<const int64_t*>(positions.data));
    }
  });
  check_launch("rotary_embedding");
}

void silu_and_mul(const TensorView& out, const TensorView& x, void* stream) {
  const int64_t rows = out.shape[0], n = out.shape[1];
  if (rows * n == 0) return;
  const DeviceGuard guard(x.device.index);
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((rows * n + kThreads - 1) / kThreads, 65535);
  for_dtype(x.dtype, "silu_and_mul", [&](auto zero) {
    using T = decltype(zero);
    silu_and_mul_kernel<T>
        <<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
            typed<T>(out), out.strides[0], typed<T>(x), x.strides[0], rows, n);
  });
  check_launch("silu_and_mul");
}

void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping,
                       void* stream) {
  const int64_t tokens = key.shape[0];
  if (tokens == 0) return;
  const int kv_heads = static_cast<int>(key_cache.shape[1]);
  const int d = static_cast<int>(key_cache.shape[2]);
  const int block_size = static_cast<int>(key_cache.shape[3]);
  const DeviceGuard guard(key.device.index);
  for_dtype(key_cache.dtype, "reshape_and_cache", [&](auto zero) {
    using T = decltype(zero);
    reshape_and_cache_kernel<T><<<static_cast<unsigned>(tokens), threads_for(kv_heads * d), 0,
                                  static_cast<cudaStream_t>(stream)>>>(
        typed<T>(key), key.strides[0], key.strides[1], typed<T>(value), value.strides[0],
        value.strides[1], typed<T>(key_cache), typed<T>(value_cache),
        static_cast<const int64_t*>(slot_mapping.data), slot_mapping.strides[0], kv_heads, d,
        block_size, key_cache.shape[0] * static_cast<int64_t>(block_size));
  });
  check_launch("reshape_and_cache");
}

}  // namespace pyengine::cuda
