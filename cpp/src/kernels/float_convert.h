// Portable conversions between float and the 16-bit cache dtypes (no F16C needed), and
// typed loads/stores used by the CPU kernels. Internal to pyengine_core.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "pyengine/tensor_view.h"

namespace pyengine::detail {

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t bits = float_to_bits(f);
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x40);  // keep NaN a NaN
  }
  const uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);  // to nearest, ties to even
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return bits_to_float(sign | 0x7F800000u | (mantissa << 13));
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  // Subnormal (or zero): mantissa * 2^-24.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return sign != 0 ? -magnitude : magnitude;
}

inline uint16_t float_to_fp16(float f) {
  const uint32_t bits = float_to_bits(f);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u)
    return static_cast<uint16_t>(sign | 0x7C00u | (abs > 0x7F800000u ? 0x200u : 0));
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to infinity
  if (abs < 0x38800000u) {  // subnormal half: round abs * 2^24 to an integer, ties to even
    const float scaled = bits_to_float(abs) * 16777216.0f;
    auto q = static_cast<uint32_t>(scaled);
    const float rest = scaled - static_cast<float>(q);
    if (rest > 0.5f || (rest == 0.5f && (q & 1u) != 0)) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  const uint32_t rounding = 0xFFFu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((abs - 0x38000000u + rounding) >> 13));
}

// A KV cache of fp8 e4m3 (OCP's E4M3FN: 1 sign, 4 exponent bits of bias 7, 3 mantissa
// bits; no infinities, 0x7F/0xFF NaN) is stored as uint8: kFp8Cache is its dtype here.
inline constexpr DType kFp8Cache = DType::kUInt8;

// An int8 KV cache (CPU) keeps a float32 scale per token and kv head beside its values:
// each token's head_size values are round(x / s) with s = max|x| / 127. Its caches'
// head dims are kInt8ScaleBytes longer: keys [blocks, heads, head_size + 4, block_size],
// the last 4 rows of a tile the block's block_size scales (float32, in token order);
// values [blocks, heads, block_size, head_size + 4], each token's row ending in its scale.
inline constexpr DType kInt8Cache = DType::kInt8;
inline constexpr int64_t kInt8ScaleBytes = 4;

// max |x[i]|, by the bits: a non-negative float's order is its bits' as an integer, and
// an integer maximum vectorizes where a float one (NaN's order) does not. A NaN wins.
inline float max_abs(const float* x, int64_t n) {
  uint32_t top = 0;
  for (int64_t i = 0; i < n; ++i) top = std::max(top, float_to_bits(x[i]) & 0x7FFFFFFFu);
  return bits_to_float(top);
}

// The scale of an int8 cache row: max|x| / 127 (0 for a row of zeros).
inline float int8_row_scale(const float* x, int64_t n) { return max_abs(x, n) / 127.0f; }

// x / scale rounded to nearest (ties to even) as int8, clamped to [lowest, 127]: -127
// for a row's own symmetric scale, -128 for a checkpoint's (compressed-tensors' int8
// range); 0 where scale is 0 or x / scale is NaN (a non-finite K or V).
inline int8_t int8_quantize(float x, float scale, float lowest = -127.0f) {
  if (scale == 0.0f) return 0;
  const float q = std::nearbyint(x / scale);
  if (std::isnan(q)) return 0;
  return static_cast<int8_t>(std::clamp(q, lowest, 127.0f));
}

// e4m3's bits, moved into a float16's (exponent bias 15: the value / 256), exactly: a
// subnormal e4m3 lands on a float16 subnormal of the same mantissa.
inline uint16_t fp8_e4m3_to_half_bits(uint8_t b) {
  return static_cast<uint16_t>(((b & 0x7Fu) << 7) | ((b & 0x80u) << 8));
}

inline float fp8_e4m3_to_float(uint8_t b) {
  if ((b & 0x7Fu) == 0x7Fu) return std::numeric_limits<float>::quiet_NaN();
  return fp16_to_float(fp8_e4m3_to_half_bits(b)) * 256.0f;
}

// To nearest, ties to even; beyond the largest finite value (448) saturated to it, as
// vLLM's fp8 caches store; NaN stays NaN.
inline uint8_t float_to_fp8_e4m3(float f) {
  const uint32_t bits = float_to_bits(f);
  const auto sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7Fu);
  if (abs >= 0x43E00000u) return static_cast<uint8_t>(sign | 0x7Eu);  // >= 448
  if (abs < 0x3C800000u) {  // under 2^-6: a subnormal step of 2^-9, ties to even
    const float scaled = bits_to_float(abs) * 512.0f;
    auto q = static_cast<uint32_t>(scaled);
    const float rest = scaled - static_cast<float>(q);
    if (rest > 0.5f || (rest == 0.5f && (q & 1u) != 0)) ++q;
    return static_cast<uint8_t>(sign | q);  // q = 8 is the smallest normal, 0x08
  }
  const uint32_t rounding = 0x7FFFFu + ((abs >> 20) & 1u);
  const uint32_t rounded = (abs + rounding) >> 20;  // exponent and 3 mantissa bits
  const uint32_t value = rounded - ((127u - 7u) << 3);
  return static_cast<uint8_t>(sign | std::min<uint32_t>(value, 0x7Eu));
}

// Element i of a float32 / float16 / bfloat16 / fp8 e4m3 array as float.
template <DType kDType>
inline float load(const void* base, int64_t i) {
  if constexpr (kDType == DType::kFloat32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (kDType == DType::kFloat16) {
    return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
  } else if constexpr (kDType == kFp8Cache) {
    return fp8_e4m3_to_float(static_cast<const uint8_t*>(base)[i]);
  } else {
    return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

template <DType kDType>
inline void store(void* base, int64_t i, float value) {
  if constexpr (kDType == DType::kFloat32) {
    static_cast<float*>(base)[i] = value;
  } else if constexpr (kDType == DType::kFloat16) {
    static_cast<uint16_t*>(base)[i] = float_to_fp16(value);
  } else if constexpr (kDType == kFp8Cache) {
    static_cast<uint8_t*>(base)[i] = float_to_fp8_e4m3(value);
  } else {
    static_cast<uint16_t*>(base)[i] = float_to_bf16(value);
  }
}

}  // namespace pyengine::detail
