// 8-bit KV caches on CUDA, in the CPU's layouts and arithmetic (cpp/src/kernels/
// float_convert.h), so that a cache written on either reads the same on both:
//   fp8:  e4m3 bytes (OCP E4M3FN), x / k_scale or x / v_scale where a checkpoint gives
//         static scales, rounded to nearest and saturated to +-448;
//   int8: round(x / s) per token and kv head, s = max|row| / 127 (or a static scale,
//         clamped to [-128, 127]), with s as float32 beside the values: keys
//         [blocks, heads, d + 4, block_size] (the tile's last 4 rows the block_size
//         scales, in token order), values [blocks, heads, block_size, d + 4].
// Their writer, reshape_and_cache_8bit_kernel, and what the scalar attention kernel reads
// them with. Device code and plain C++ only (cuda_host_emulation.h). Internal to cuda/.
#pragma once

#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cuda/element_types.cuh"

namespace pyengine::cuda {

// Bytes an int8 cache's head dims are longer by: its float32 scale.
constexpr int kInt8ScaleBytes = 4;

// The head-dim padding of a cache of element type C (int8: its scale).
template <typename C>
constexpr int kCachePad = std::is_same_v<C, int8_t> ? kInt8ScaleBytes : 0;

__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(int8_t x) { return static_cast<float>(x); }

// An int8 cache's float32 scale at a 4-byte aligned address (the layouts keep it so:
// head sizes are multiples of 16).
__device__ __forceinline__ float scale_at(const int8_t* p) {
  return *reinterpret_cast<const float*>(p);
}

__device__ __forceinline__ uint32_t magnitude_bits(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  return bits & 0x7FFFFFFFu;
}

// max |x| over the lanes' `bits` (magnitude_bits: a non-negative float orders as its
// bits; a NaN wins, as on the CPU), returned to every lane.
__device__ __forceinline__ float warp_max_magnitude(uint32_t bits) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, bits, offset);
    bits = other > bits ? other : bits;
  }
  float x;
  memcpy(&x, &bits, sizeof x);
  return x;
}

// x / scale to nearest (ties to even), clamped to [lowest, 127]; 0 where scale is 0 or the
// quotient NaN (float_convert.h's int8_quantize).
__device__ __forceinline__ int8_t quantize_int8(float x, float scale, float lowest) {
  if (scale == 0.0f) return 0;
  const float q = rintf(x / scale);
  if (q != q) return 0;
  return static_cast<int8_t>(fminf(fmaxf(q, lowest), 127.0f));
}

// A warp per (token, kv head): lanes over the head dims. The int8 row scale is the warp's
// maximum, so every lane takes the whole row (head_size over 32 at a time).
template <typename T, typename C>
__global__ void reshape_and_cache_8bit_kernel(
    const T* __restrict__ key, int64_t key_token_stride, int64_t key_head_stride,
    const T* __restrict__ value, int64_t value_token_stride, int64_t value_head_stride,
    C* __restrict__ key_cache, C* __restrict__ value_cache, const int64_t* __restrict__ slots,
    int64_t slot_stride, int num_kv_heads, int head_size, int block_size, int64_t num_slots,
    float k_scale, float v_scale) {
  constexpr int kPad = kCachePad<C>;
  const int64_t token = blockIdx.x;
  const int head = static_cast<int>(blockIdx.y), lane = static_cast<int>(threadIdx.x);
  const int64_t slot = slots[token * slot_stride];
  if (slot < 0 || slot >= num_slots) return;  // see layer_kernels_launch.h
  const int64_t block = slot / block_size, offset = slot % block_size;
  const int64_t tile = (block * num_kv_heads + head) * block_size * (head_size + kPad);
  const T* k_row = key + token * key_token_stride + head * key_head_stride;
  const T* v_row = value + token * value_token_stride + head * value_head_stride;
  C* k_tile = key_cache + tile;
  C* v_out = value_cache + tile + offset * (head_size + kPad);
  if constexpr (std::is_same_v<C, int8_t>) {
    uint32_t k_top = 0, v_top = 0;
    for (int i = lane; i < head_size; i += kWarp) {
      const uint32_t k_bits = magnitude_bits(to_float(k_row[i]));
      const uint32_t v_bits = magnitude_bits(to_float(v_row[i]));
      k_top = k_bits > k_top ? k_bits : k_top;
      v_top = v_bits > v_top ? v_bits : v_top;
    }
    // A checkpoint's static scale was computed for compressed-tensors' [-128, 127].
    const float k_s = k_scale > 0.0f ? k_scale : warp_max_magnitude(k_top) / 127.0f;
    const float v_s = v_scale > 0.0f ? v_scale : warp_max_magnitude(v_top) / 127.0f;
    const float k_lowest = k_scale > 0.0f ? -128.0f : -127.0f;
    const float v_lowest = v_scale > 0.0f ? -128.0f : -127.0f;
    for (int i = lane; i < head_size; i += kWarp) {
      k_tile[static_cast<int64_t>(i) * block_size + offset] =
          quantize_int8(to_float(k_row[i]), k_s, k_lowest);
      v_out[i] = quantize_int8(to_float(v_row[i]), v_s, v_lowest);
    }
    if (lane == 0) {
      memcpy(k_tile + static_cast<int64_t>(head_size) * block_size + offset * kPad, &k_s,
             sizeof k_s);
      memcpy(v_out + head_size, &v_s, sizeof v_s);
    }
  } else {
    const float k_divisor = k_scale > 0.0f ? k_scale : 1.0f;
    const float v_divisor = v_scale > 0.0f ? v_scale : 1.0f;
    for (int i = lane; i < head_size; i += kWarp) {
      k_tile[static_cast<int64_t>(i) * block_size + offset] =
          C(to_float(k_row[i]) / k_divisor);  // saturated to the largest finite, as vLLM's
      v_out[i] = C(to_float(v_row[i]) / v_divisor);
    }
  }
}

// f(C{}) for an 8-bit cache's element type: uint8 holds fp8 e4m3 bytes, int8 the scaled
// integers.
template <class F>
void for_8bit_cache(DType cache, const char* op, F&& f) {
  switch (cache) {
    case DType::kUInt8: return f(__nv_fp8_e4m3{});
    case DType::kInt8: return f(int8_t{});
    default: throw std::invalid_argument(std::string(op) + " (CUDA): not an 8-bit cache");
  }
}

inline bool is_8bit_cache(DType cache) { return cache == DType::kUInt8 || cache == DType::kInt8; }

// f(T{}) for a 16-bit activation dtype: what an 8-bit cache takes on CUDA.
template <class F>
void for_16bit_dtype(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::kFloat16: return f(__half{});
    case DType::kBFloat16: return f(__nv_bfloat16{});
    default:
      throw std::invalid_argument(std::string(op) + " (CUDA): an 8-bit cache takes float16 " +
                                  "or bfloat16 activations");
  }
}

}  // namespace pyengine::cuda
