// What the CUDA kernels share about their element types and warps: float32 arithmetic
// over float, half or bfloat16 storage, warp reductions, and the host-side pick of a
// kernel's element type. Internal to cuda/.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "pyengine/tensor_view.h"

namespace pyengine::cuda {

constexpr int kWarp = 32;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// W consecutive elements moved as one access of W * sizeof(T) bytes (16 at most: one
// 128-bit load or store where W = kPackWidth<T>). The address must be aligned to that
// size; launchers check it (with_pack_width) and otherwise run the W = 1 kernel.
template <typename T, int W>
struct alignas(sizeof(T) * W) Pack {
  T v[W];
};
template <typename T>
constexpr int kPackWidth = 16 / static_cast<int>(sizeof(T));

template <typename T, int W>
__device__ __forceinline__ Pack<T, W> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, W>*>(p);
}
template <typename T, int W>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, W>& x) {
  *reinterpret_cast<Pack<T, W>*>(p) = x;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// f(T{}) for the element type of `dtype` (float32, float16, bfloat16; the glue admits
// only those).
template <class F>
void for_dtype(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f(float{});
    case DType::kFloat16: return f(__half{});
    case DType::kBFloat16: return f(__nv_bfloat16{});
    default: throw std::invalid_argument(std::string(op) + " (CUDA): unsupported dtype");
  }
}

}  // namespace pyengine::cuda
