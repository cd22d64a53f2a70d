// Block-quantized panels (layout in quantized_panel.h): packing from [k, n] integers,
// scales and offsets, and widening to float32.
#include "quantized_panel.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "tensor_checks.h"
#include "vector_clones.h"

namespace pyengine {
namespace {

using detail::QuantCode;
using detail::QuantForm;
using detail::quantized_block_bytes;

constexpr int kLanes = 16;

// The code of pack_quantized_weight's operands: the packed dtype's, kInt8Halves where
// an int8 weight's scales are per 16 rows (scale_t [k / 16, n]).
QuantCode operand_code(const TensorView& packed, const TensorView& q_t, const TensorView& scale_t) {
  const QuantCode code = detail::quant_code(packed.dtype);
  const bool halves = code == QuantCode::kInt8 && q_t.ndim == 2 && scale_t.ndim == 2 &&
                      scale_t.shape[0] == q_t.shape[0] / (kQuantBlock / 2);
  return halves ? QuantCode::kInt8Halves : code;
}

// Whether every value of a float32 [rows, n] view is a float16 exactly (or, zero_only,
// zero).
bool all_values(const TensorView& t, bool zero_only) {
  for (int64_t g = 0; g < t.shape[0]; ++g) {
    const auto* row = static_cast<const float*>(t.data) + g * t.strides[0];
    for (int64_t j = 0; j < t.shape[1]; ++j) {
      if (zero_only ? row[j] != 0.0f : detail::fp16_to_float(detail::float_to_fp16(row[j])) != row[j]) {
        return false;
      }
    }
  }
  return true;
}

void check_quantized_args(const char* op, const TensorView& packed, const TensorView& q_t,
                          const TensorView& scale_t, const TensorView& offset_t, bool gate_up,
                          QuantParams params) {
  detail::check_cpu(packed, op, "packed");
  if (detail::quant_code(packed.dtype) == QuantCode::kNone) {
    throw InvalidArgument(detail::arg(op, "packed") +
                          " must be uint8 (4-bit weights), int8 (8-bit) or float8_e4m3fn, got " +
                          packed.describe());
  }
  detail::check_rows(q_t, op, "q_t", 2, packed.dtype);
  const QuantCode code = operand_code(packed, q_t, scale_t);
  const int bits = detail::quantized_bits(code);
  const int64_t k = q_t.shape[0], n = q_t.shape[1], rows = detail::quantized_group_rows(code);
  if (k % kQuantBlock != 0) {
    throw InvalidArgument(std::string(op) + ": k (q_t's rows) must be a multiple of " +
                          std::to_string(kQuantBlock) + ", got " + q_t.describe());
  }
  if (gate_up && n % 2 != 0) {
    throw InvalidArgument(std::string(op) + ": q_t must be [k, 2n] (gate columns, then up), got " +
                          q_t.describe());
  }
  for (const auto& [t, name] : {std::pair{&scale_t, "scale_t"}, std::pair{&offset_t, "offset_t"}}) {
    detail::check_rows(*t, op, name, 2, DType::kFloat32);
    if (t->shape[0] != k / rows || t->shape[1] != n) {
      throw InvalidArgument(detail::arg(op, name) + " must be [" + std::to_string(k / rows) +
                            ", " + std::to_string(n) + "] (a group of " + std::to_string(rows) +
                            " rows of q_t each; int8 weights may have groups of 16), got " +
                            t->describe());
    }
  }
  // Where an offset is not zero, q * scale must be exact in float32, so that any rounding
  // of q * scale + offset (a multiply-add, or the product, then the sum) is one: a scale
  // of at most 24 - (q's bits) significant bits (q 4 bits, or an int8: 7, 128 being a
  // power of two). A zero offset leaves one rounding however it is computed. fp8 weights
  // take no offset.
  const int scale_bits = bits == 4 ? 20 : 17;
  const uint32_t low_mantissa = (uint32_t{1} << (24 - scale_bits)) - 1;
  for (int64_t g = 0; g < k / rows; ++g) {
    const auto* scale = static_cast<const float*>(scale_t.data) + g * scale_t.strides[0];
    const auto* offset = static_cast<const float*>(offset_t.data) + g * offset_t.strides[0];
    for (int64_t j = 0; j < n; ++j) {
      if (offset[j] == 0.0f) continue;
      if (code == QuantCode::kFp8) {
        throw InvalidArgument(std::string(op) + ": fp8 weights take no offset: offset_t must " +
                              "be zero, group row " + std::to_string(g) + " is not");
      }
      if ((std::bit_cast<uint32_t>(scale[j]) & low_mantissa) != 0) {
        throw InvalidArgument(std::string(op) + ": scale_t must have at most " +
                              std::to_string(scale_bits) + " significant bits for " +
                              std::to_string(bits) + "-bit q with an offset (a float16's 11 " +
                              "times a 6-bit integer fit), so that q * scale is exact; group " +
                              "row " + std::to_string(g) + " has more");
      }
    }
  }
  if (!detail::quantized_params_allowed(code, params)) {
    throw InvalidArgument(std::string(op) + ": groups of 16 rows take float32 scales and " +
                          "offsets only, fp8 weights float32 ones or float32 scales alone, " +
                          "and only they take float32 scales alone");
  }
  if (!detail::quantized_float32_scales(params) && !all_values(scale_t, false)) {
    throw InvalidArgument(std::string(op) + ": float16 parameters, and scale_t holds a value " +
                          "that is not a float16 (narrowest_quant_params says which fit)");
  }
  if ((params == QuantParams::kFloat16 && !all_values(offset_t, false)) ||
      (!detail::quantized_offsets_stored(params) && !all_values(offset_t, true))) {
    throw InvalidArgument(std::string(op) + ": offset_t holds a value that its parameters " +
                          "(float16 offsets, or none) cannot (narrowest_quant_params says which fit)");
  }
  const int64_t size = gate_up ? 2 * packed_quantized_weight_size(k, n / 2, bits, rows, params)
                               : packed_quantized_weight_size(k, n, bits, rows, params);
  if (packed.ndim != 1 || packed.shape[0] != size || packed.strides[0] != 1) {
    throw InvalidArgument(detail::arg(op, "packed") + " must be dense [" + std::to_string(size) +
                          "], got " + packed.describe());
  }
  if (code == QuantCode::kFp8) {
    for (int64_t i = 0; i < k; ++i) {
      const auto* row = static_cast<const uint8_t*>(q_t.data) + i * q_t.strides[0];
      if (std::any_of(row, row + n, [](uint8_t q) { return (q & 0x7F) == 0x7F; })) {
        throw InvalidArgument(std::string(op) + ": fp8 q_t row " + std::to_string(i) +
                              " holds a NaN");
      }
    }
  }
  if (bits == 4) {
    for (int64_t i = 0; i < k; ++i) {
      const auto* row = static_cast<const uint8_t*>(q_t.data) + i * q_t.strides[0];
      if (std::any_of(row, row + n, [](uint8_t q) { return q > 15; })) {
        throw InvalidArgument(std::string(op) + ": a 4-bit q_t holds values 0..15, row " +
                              std::to_string(i) + " has more");
      }
    }
  }
}

// One group's scales and offsets of a panel, at `params`, as `form` stores them.
void pack_group_params(uint8_t* params, const float* scale, const float* offset, int64_t width,
                       QuantParams form) {
  for (int64_t j = 0; j < width; ++j) {
    if (detail::quantized_float32_scales(form)) {
      reinterpret_cast<float*>(params)[j] = scale[j];
      if (form == QuantParams::kFloat32) {
        reinterpret_cast<float*>(params)[kPanelWidth + j] = offset[j];
      }
    } else {
      reinterpret_cast<uint16_t*>(params)[j] = detail::float_to_fp16(scale[j]);
      if (form == QuantParams::kFloat16) {
        reinterpret_cast<uint16_t*>(params)[kPanelWidth + j] = detail::float_to_fp16(offset[j]);
      }
    }
  }
}

// Columns [first, first + width) of q_t/scale_t/offset_t as one quantized panel at dst;
// the columns past width are zero (so they widen to zero).
void pack_quantized_panel(uint8_t* dst, const TensorView& q_t, const TensorView& scale_t,
                          const TensorView& offset_t, int64_t first, int64_t width,
                          QuantForm form) {
  const QuantCode code = form.code;
  const auto* q = static_cast<const uint8_t*>(q_t.data);
  const int64_t k = q_t.shape[0], rows = detail::quantized_group_rows(code);
  const int bits = detail::quantized_bits(code);
  for (int64_t b = 0; b < k / kQuantBlock; ++b) {
    uint8_t* block = dst + b * quantized_block_bytes(form);
    const int64_t param_bytes = detail::quantized_param_bytes(form);
    std::memset(block, 0, static_cast<size_t>(param_bytes));
    uint8_t* ints = block + param_bytes;
    // (the columns past width: q 0, whose biased byte is 128)
    std::memset(ints, detail::quantized_biased(code) ? 128 : 0,
                static_cast<size_t>(quantized_block_bytes(form) - param_bytes));
    for (int64_t g = 0; g < kQuantBlock / rows; ++g) {
      const int64_t group = b * (kQuantBlock / rows) + g;
      pack_group_params(
          block + g * detail::quantized_group_param_bytes(form.params),
          static_cast<const float*>(scale_t.data) + group * scale_t.strides[0] + first,
          static_cast<const float*>(offset_t.data) + group * offset_t.strides[0] + first, width,
          form.params);
    }
    for (int64_t i = 0; i < kQuantBlock; ++i) {
      const uint8_t* row = q + (b * kQuantBlock + i) * q_t.strides[0] + first;
      for (int64_t j = 0; j < width; ++j) {
        uint8_t& byte = ints[detail::quantized_byte(i, j, code)];
        if (bits == 4) {
          byte |= static_cast<uint8_t>(row[j] << detail::quantized_nibble_shift(i));
        } else {
          byte = detail::quantized_biased(code) ? static_cast<uint8_t>(row[j] ^ 0x80) : row[j];
        }
      }
    }
  }
}

}  // namespace

QuantParams narrowest_quant_params(const TensorView& q_t, const TensorView& scale_t,
                                   const TensorView& offset_t) {
  constexpr const char* op = "narrowest_quant_params";
  for (const auto& [t, name] : {std::pair{&scale_t, "scale_t"}, std::pair{&offset_t, "offset_t"}}) {
    detail::check_rows(*t, op, name, 2, DType::kFloat32);
  }
  const bool halves = q_t.ndim == 2 && scale_t.shape[0] != q_t.shape[0] / kQuantBlock;
  if (q_t.dtype == DType::kFloat8E4M3) {
    return all_values(offset_t, true) ? QuantParams::kScaleFloat32 : QuantParams::kFloat32;
  }
  if (halves || !all_values(scale_t, false)) return QuantParams::kFloat32;
  if (all_values(offset_t, true)) return QuantParams::kScaleFloat16;
  return all_values(offset_t, false) ? QuantParams::kFloat16 : QuantParams::kFloat32;
}

int64_t packed_quantized_weight_size(int64_t k, int64_t n, int bits, int64_t group_rows,
                                     QuantParams params) {
  if (bits != 4 && bits != 8) {
    throw InvalidArgument("packed_quantized_weight_size: bits must be 4 or 8, got " +
                          std::to_string(bits));
  }
  if (group_rows != kQuantBlock && !(bits == 8 && group_rows == kQuantBlock / 2)) {
    throw InvalidArgument("packed_quantized_weight_size: group_rows must be 32 (or 16 for " +
                          std::string("8 bits), got ") + std::to_string(group_rows));
  }
  if (k % kQuantBlock != 0) {
    throw InvalidArgument("packed_quantized_weight_size: k must be a multiple of " +
                          std::to_string(kQuantBlock) + ", got " + std::to_string(k));
  }
  if (group_rows != kQuantBlock && params != QuantParams::kFloat32) {
    throw InvalidArgument("packed_quantized_weight_size: groups of 16 rows take float32 params");
  }
  const QuantCode code = bits == 4                     ? QuantCode::kNibble
                         : group_rows == kQuantBlock ? QuantCode::kInt8  // (fp8: as int8)
                                                     : QuantCode::kInt8Halves;
  return (n + kPanelWidth - 1) / kPanelWidth * detail::quantized_panel_bytes({code, params}, k);
}

void pack_quantized_weight(const TensorView& packed, const TensorView& q_t,
                           const TensorView& scale_t, const TensorView& offset_t, bool gate_up,
                           QuantParams params) {
  check_quantized_args("pack_quantized_weight", packed, q_t, scale_t, offset_t, gate_up, params);
  const QuantForm form{operand_code(packed, q_t, scale_t), params};
  const int64_t k = q_t.shape[0], n = gate_up ? q_t.shape[1] / 2 : q_t.shape[1];
  const int64_t panel_bytes = detail::quantized_panel_bytes(form, k);
  auto* dst = static_cast<uint8_t*>(packed.data);
  detail::for_each_packed_panel(n, gate_up, [&](int64_t slot, int64_t first, int64_t width) {
    pack_quantized_panel(dst + slot * panel_bytes, q_t, scale_t, offset_t, first, width, form);
  });
}

namespace {

// Rows of 16 columns: q * scale + offset, from 16 int8, 16 fp8 bytes, or the 16 nibbles
// of a row pair.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PYENGINE_WIDEN_AVX512 __attribute__((target("avx512f,avx512bw")))
// GCC 12 takes the intrinsics' undefined pass-through vectors for uninitialized reads.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// q of row b (of the lane rows) of the 16 columns whose lanes are w (a biased int8
// code's with its bias already flipped off: w ^ 0x80 bytes), as float. An fp8 byte
// becomes the float16 of its value / 256 (fp8_e4m3_to_half_bits), so its scale comes
// times 256 (`scale` of load_params), which changes no product.
// (Called in loops over the rows that unroll, so that the shifts are immediates.)
template <QuantCode kCode>
PYENGINE_WIDEN_AVX512 inline __m512 lane_q(__m512i w, int row) {
  if constexpr (kCode == QuantCode::kNibble) {
    const unsigned shift = 8 * (row % 4) + 4 * (row / 4);
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, shift), _mm512_set1_epi32(15)));
  } else if constexpr (kCode == QuantCode::kFp8) {
    const __m256i b = _mm512_cvtepi32_epi16(
        _mm512_and_si512(_mm512_srli_epi32(w, 8 * row), _mm512_set1_epi32(0xFF)));
    const __m256i half =
        _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                        _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
    return _mm512_cvtph_ps(half);
  } else {  // (sign-extended from the row's byte)
    return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w, 24 - 8 * row), 24));
  }
}

// The lanes of 16 columns of a group at src, as lane_q takes them.
template <QuantCode kCode>
PYENGINE_WIDEN_AVX512 inline __m512i load_lanes(const uint8_t* src) {
  const __m512i w = _mm512_loadu_si512(src);
  if constexpr (detail::quantized_biased(kCode)) return _mm512_xor_si512(w, _mm512_set1_epi8(-128));
  return w;
}

// The scale and offset vectors of row i's group, columns [v * 16, v * 16 + 16), as
// lane_q's widenings take them.
template <QuantCode kCode>
PYENGINE_WIDEN_AVX512 inline void load_params(const uint8_t* block, int64_t i, int v,
                                              QuantParams params, __m512& scale, __m512& offset) {
  detail::load_quantized_params(block, i, v, QuantForm{kCode, params}, scale, offset);
  if constexpr (kCode == QuantCode::kFp8) scale = _mm512_mul_ps(scale, _mm512_set1_ps(256.0f));
}

template <QuantCode kCode>
PYENGINE_WIDEN_AVX512 void widen_block_avx512(const uint8_t* block, QuantParams params, float* out) {
  constexpr int64_t kGroupRows = detail::quantized_group_rows(kCode);
  constexpr int kLaneRows = detail::quantized_lane_rows(kCode);
  const uint8_t* ints = block + detail::quantized_param_bytes(QuantForm{kCode, params});
  for (int v = 0; v < kPanelWidth / kLanes; ++v) {
    __m512 scale, offset;
    for (int64_t i0 = 0; i0 < kQuantBlock; i0 += kLaneRows) {
      if (i0 % kGroupRows == 0) load_params<kCode>(block, i0, v, params, scale, offset);
      const __m512i w = load_lanes<kCode>(ints + (i0 / kLaneRows * kPanelWidth + v * kLanes) * 4);
      float* dst = out + i0 * kPanelWidth + v * kLanes;
#pragma GCC unroll 8
      for (int b = 0; b < kLaneRows; ++b) {
        _mm512_storeu_ps(dst + b * kPanelWidth, _mm512_fmadd_ps(lane_q<kCode>(w, b), scale, offset));
      }
    }
  }
}
#pragma GCC diagnostic pop
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// The same widenings at AVX2's width: 8 columns a vector, the same bits (each value
// exact, then one multiply-add).
#define PYENGINE_WIDEN_AVX2 __attribute__((target("avx2,fma,f16c")))
constexpr int kLanes2 = 8;

template <QuantCode kCode>
PYENGINE_WIDEN_AVX2 inline __m256 lane_q_avx2(__m256i w, int row) {
  if constexpr (kCode == QuantCode::kNibble) {
    const int shift = 8 * (row % 4) + 4 * (row / 4);
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, shift), _mm256_set1_epi32(15)));
  } else if constexpr (kCode == QuantCode::kFp8) {
    // (float16 bits of value / 256 in 32-bit lanes, packed to 16 bits: lanes 0-3 and 4-7
    // of packus' two halves)
    const __m256i b = _mm256_and_si256(_mm256_srli_epi32(w, 8 * row), _mm256_set1_epi32(0xFF));
    const __m256i half =
        _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), 7),
                        _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 8));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(half, half), 0x08);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
  } else {
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w, 24 - 8 * row), 24));
  }
}

template <QuantCode kCode>
PYENGINE_WIDEN_AVX2 inline __m256i load_lanes_avx2(const uint8_t* src) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  if constexpr (detail::quantized_biased(kCode)) return _mm256_xor_si256(w, _mm256_set1_epi8(-128));
  return w;
}

// The scale and offset vectors of row i's group, columns [v * 8, v * 8 + 8), as
// lane_q_avx2's widenings take them.
template <QuantCode kCode>
PYENGINE_WIDEN_AVX2 inline void load_params_avx2(const uint8_t* block, int64_t i, int v,
                                                 QuantParams params, __m256& scale,
                                                 __m256& offset) {
  detail::load_quantized_params8(block, i, v, QuantForm{kCode, params}, scale, offset);
  if constexpr (kCode == QuantCode::kFp8) scale = _mm256_mul_ps(scale, _mm256_set1_ps(256.0f));
}

template <QuantCode kCode>
PYENGINE_WIDEN_AVX2 void widen_block_avx2(const uint8_t* block, QuantParams params, float* out) {
  constexpr int64_t kGroupRows = detail::quantized_group_rows(kCode);
  constexpr int kLaneRows = detail::quantized_lane_rows(kCode);
  const uint8_t* ints = block + detail::quantized_param_bytes(QuantForm{kCode, params});
  for (int v = 0; v < kPanelWidth / kLanes2; ++v) {
    __m256 scale = _mm256_setzero_ps(), offset = scale;  // (set at i0 = 0)
    for (int64_t i0 = 0; i0 < kQuantBlock; i0 += kLaneRows) {
      if (i0 % kGroupRows == 0) load_params_avx2<kCode>(block, i0, v, params, scale, offset);
      const __m256i w =
          load_lanes_avx2<kCode>(ints + (i0 / kLaneRows * kPanelWidth + v * kLanes2) * 4);
      float* dst = out + i0 * kPanelWidth + v * kLanes2;
#pragma GCC unroll 8
      for (int b = 0; b < kLaneRows; ++b) {
        _mm256_storeu_ps(dst + b * kPanelWidth,
                         _mm256_fmadd_ps(lane_q_avx2<kCode>(w, b), scale, offset));
      }
    }
  }
}
#endif

// The portable build: a group's scales and offsets looked up once, then, a lane row at a
// time, a loop over the panel's contiguous lanes that the compiler vectorizes (SSE2,
// NEON): the shifts are constants once the rows' loop unrolls.
template <QuantCode kCode>
void widen_block_portable(const uint8_t* block, QuantParams params, float* out) {
  constexpr int64_t kGroupRows = detail::quantized_group_rows(kCode);
  constexpr int kLaneRows = detail::quantized_lane_rows(kCode);
  const QuantForm form{kCode, params};
  const uint8_t* ints = block + detail::quantized_param_bytes(form);
  float scale[kPanelWidth], offset[kPanelWidth];
  uint32_t lanes[kPanelWidth];
  for (int64_t i0 = 0; i0 < kQuantBlock; i0 += kLaneRows) {
    if (i0 % kGroupRows == 0) {
      for (int64_t j = 0; j < kPanelWidth; ++j) {
        scale[j] = detail::quantized_scale(block, i0, j, form);
        offset[j] = detail::quantized_offset(block, i0, j, form);
      }
    }
    std::memcpy(lanes, ints + i0 / kLaneRows * kPanelWidth * 4, sizeof lanes);
    if constexpr (detail::quantized_biased(kCode)) {
      for (uint32_t& lane : lanes) lane ^= 0x80808080u;
    }
#pragma GCC unroll 8
    for (int b = 0; b < kLaneRows; ++b) {
      float* row = out + (i0 + b) * kPanelWidth;
      for (int64_t j = 0; j < kPanelWidth; ++j) {
        row[j] = detail::quantized_lane_value<kCode>(lanes[j], b) * scale[j] + offset[j];
      }
    }
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// acc (+)= x * w for kRows rows, x[r] at a[r * lda]; one row alternates two chains.
template <int kRows>
PYENGINE_WIDEN_AVX512 inline void add_products(__m512 (&acc)[kRows][3], __m512 (&odd)[3],
                                               const float* a, int64_t lda, bool second,
                                               const __m512 (&w)[3]) {
  for (int r = 0; r < kRows; ++r) {
    const __m512 x = _mm512_set1_ps(a[r * lda]);
    for (int v = 0; v < 3; ++v) {
      if (kRows == 1 && second) {
        odd[v] = _mm512_fmadd_ps(x, w[v], odd[v]);
      } else {
        acc[r][v] = _mm512_fmadd_ps(x, w[v], acc[r][v]);
      }
    }
  }
}

template <int kRows, QuantCode kCode>
PYENGINE_WIDEN_AVX512 void multiply_rows_avx512(const float* a, int64_t lda, const uint8_t* panel,
                                                int64_t k, QuantParams params, float* c) {
  static_assert(kPanelWidth == 3 * kLanes);
  const QuantForm form{kCode, params};
  const int64_t block_bytes = quantized_block_bytes(form);
  __m512 acc[kRows][3], odd[3];
  for (int v = 0; v < 3; ++v) {
    odd[v] = _mm512_setzero_ps();
    for (int r = 0; r < kRows; ++r) acc[r][v] = _mm512_setzero_ps();
  }
  constexpr int64_t kGroupRows = detail::quantized_group_rows(kCode);
  constexpr int kLaneRows = detail::quantized_lane_rows(kCode);
  for (int64_t b = 0; b < k / kQuantBlock; ++b) {
    const uint8_t* block = panel + b * block_bytes;
    detail::prefetch_quantized_ahead(block, block_bytes);
    __m512 scale[3], offset[3];
    const uint8_t* ints = block + detail::quantized_param_bytes(form);
    const float* x = a + b * kQuantBlock;
    for (int64_t i0 = 0; i0 < kQuantBlock; i0 += kLaneRows) {
      if (i0 % kGroupRows == 0) {
        for (int v = 0; v < 3; ++v) load_params<kCode>(block, i0, v, params, scale[v], offset[v]);
      }
      __m512i lanes[3];
      for (int v = 0; v < 3; ++v) {
        lanes[v] = load_lanes<kCode>(ints + (i0 / kLaneRows * kPanelWidth + v * kLanes) * 4);
      }
#pragma GCC unroll 8
      for (int r = 0; r < kLaneRows; ++r) {
        __m512 w[3];
        for (int v = 0; v < 3; ++v) {
          w[v] = _mm512_fmadd_ps(lane_q<kCode>(lanes[v], r), scale[v], offset[v]);
        }
        add_products<kRows>(acc, odd, x + i0 + r, lda, r % 2 == 1, w);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < 3; ++v) {
      const __m512 sum = kRows == 1 ? _mm512_add_ps(acc[0][v], odd[v]) : acc[r][v];
      _mm512_storeu_ps(c + r * kPanelWidth + v * kLanes, sum);
    }
  }
}
#pragma GCC diagnostic pop

#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// The AVX2 build of multiply_rows: the panel in three passes of 16 columns (two vectors),
// so that a pass's sums, weights, scales and offsets fit the 16 registers; each pass reads
// one line of every lane group, the first one asking for the blocks ahead for all three.
constexpr int kPassVectors = 2;

template <int kRows>
PYENGINE_WIDEN_AVX2 inline void add_products_avx2(__m256 (&acc)[kRows][kPassVectors],
                                                  __m256 (&odd)[kPassVectors], const float* a,
                                                  int64_t lda, bool second,
                                                  const __m256 (&w)[kPassVectors]) {
  for (int r = 0; r < kRows; ++r) {
    const __m256 x = _mm256_set1_ps(a[r * lda]);
    for (int v = 0; v < kPassVectors; ++v) {
      if (kRows == 1 && second) {
        odd[v] = _mm256_fmadd_ps(x, w[v], odd[v]);
      } else {
        acc[r][v] = _mm256_fmadd_ps(x, w[v], acc[r][v]);
      }
    }
  }
}

template <int kRows, QuantCode kCode>
PYENGINE_WIDEN_AVX2 void multiply_rows_avx2(const float* a, int64_t lda, const uint8_t* panel,
                                            int64_t k, QuantParams params, float* c) {
  const QuantForm form{kCode, params};
  const int64_t block_bytes = quantized_block_bytes(form);
  constexpr int64_t kGroupRows = detail::quantized_group_rows(kCode);
  constexpr int kLaneRows = detail::quantized_lane_rows(kCode);
  for (int pass = 0; pass < kPanelWidth / (kPassVectors * kLanes2); ++pass) {
    __m256 acc[kRows][kPassVectors], odd[kPassVectors];
    for (int v = 0; v < kPassVectors; ++v) {
      odd[v] = _mm256_setzero_ps();
      for (int r = 0; r < kRows; ++r) acc[r][v] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < k / kQuantBlock; ++b) {
      const uint8_t* block = panel + b * block_bytes;
      if (pass == 0) detail::prefetch_quantized_ahead(block, block_bytes);
      __m256 scale[kPassVectors] = {}, offset[kPassVectors] = {};
      const uint8_t* ints = block + detail::quantized_param_bytes(form);
      const float* x = a + b * kQuantBlock;
      for (int64_t i0 = 0; i0 < kQuantBlock; i0 += kLaneRows) {
        if (i0 % kGroupRows == 0) {
          for (int v = 0; v < kPassVectors; ++v) {
            load_params_avx2<kCode>(block, i0, pass * kPassVectors + v, params, scale[v],
                                    offset[v]);
          }
        }
        __m256i lanes[kPassVectors];
        for (int v = 0; v < kPassVectors; ++v) {
          const int64_t column = (pass * kPassVectors + v) * kLanes2;
          lanes[v] = load_lanes_avx2<kCode>(ints + (i0 / kLaneRows * kPanelWidth + column) * 4);
        }
#pragma GCC unroll 8
        for (int r = 0; r < kLaneRows; ++r) {
          __m256 w[kPassVectors];
          for (int v = 0; v < kPassVectors; ++v) {
            w[v] = _mm256_fmadd_ps(lane_q_avx2<kCode>(lanes[v], r), scale[v], offset[v]);
          }
          add_products_avx2<kRows>(acc, odd, x + i0 + r, lda, r % 2 == 1, w);
        }
      }
    }
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kPassVectors; ++v) {
        const __m256 sum = kRows == 1 ? _mm256_add_ps(acc[0][v], odd[v]) : acc[r][v];
        _mm256_storeu_ps(c + r * kPanelWidth + (pass * kPassVectors + v) * kLanes2, sum);
      }
    }
  }
}

#endif

bool avx512_supported() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
}

CpuIsa widest_quantized_isa() {
  if (avx512_supported()) return CpuIsa::kAvx512;
  return cpu_supports(CpuIsa::kAvx2) ? CpuIsa::kAvx2 : CpuIsa::kGeneric;
}

std::atomic<CpuIsa>& isa_in_use() {
  static std::atomic<CpuIsa> in_use{widest_quantized_isa()};
  return in_use;
}

}  // namespace

void set_quantized_dense_isa(CpuIsa isa) {
  if ((isa == CpuIsa::kAvx512 && !avx512_supported()) || (isa == CpuIsa::kAvx2 && !cpu_supports(CpuIsa::kAvx2))) {
    throw InvalidArgument("set_quantized_dense_isa: this CPU cannot run that build");
  }
  isa_in_use().store(isa == CpuIsa::kAuto ? widest_quantized_isa() : isa);
}

CpuIsa quantized_dense_isa() { return isa_in_use().load(); }

namespace detail {

// (q * scale is exact, pack_quantized_weight checks: a multiply-add rounds as the
// product, then the sum.)
bool quantized_avx512() {
  return isa_in_use().load(std::memory_order_relaxed) == CpuIsa::kAvx512;
}

void widen_quantized_panel(const uint8_t* src, int64_t k, QuantForm form, float* dst) {
  const int64_t block_bytes = quantized_block_bytes(form);
  const auto widen_all = [&](auto&& widen_block) {
    for (int64_t b = 0; b < k / kQuantBlock; ++b) {
      const uint8_t* block = src + b * block_bytes;
      detail::prefetch_quantized_ahead(block, block_bytes);
      widen_block(block, form.params, dst + b * kQuantBlock * kPanelWidth);
    }
  };
  with_quant_code(form.code, [&](auto code) {
    constexpr QuantCode kCode = decltype(code)::value;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    const CpuIsa isa = isa_in_use().load(std::memory_order_relaxed);
    if (isa == CpuIsa::kAvx512) return widen_all(widen_block_avx512<kCode>);
    if (isa == CpuIsa::kAvx2) return widen_all(widen_block_avx2<kCode>);
#endif
    widen_all(widen_block_portable<kCode>);
  });
}

void multiply_quantized_rows(const float* a, int64_t lda, int rows, const uint8_t* panel,
                             int64_t k, QuantForm form, float* c) {
  const QuantParams params = form.params;
  with_quant_code(form.code, [&](auto code) {
    constexpr QuantCode kCode = decltype(code)::value;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    const CpuIsa isa = isa_in_use().load(std::memory_order_relaxed);
    if (isa == CpuIsa::kAvx512 || isa == CpuIsa::kAvx2) {
      if (isa == CpuIsa::kAvx512) {
        return with_register_rows<kWideRegisterRows>(rows, [&](auto n) {
          multiply_rows_avx512<decltype(n)::value, kCode>(a, lda, panel, k, params, c);
        });
      }
      return with_register_rows(rows, [&](auto n) {
        multiply_rows_avx2<decltype(n)::value, kCode>(a, lda, panel, k, params, c);
      });
    }
#endif
    multiply_rows_portable<kCode>(a, lda, rows, panel, k, params, c);
  });
}

}  // namespace detail
}  // namespace pyengine

namespace pyengine::detail {

QuantForm quantized_panel_form(DType dtype, int64_t bytes, int64_t k, int64_t n) {
  const QuantCode code = quant_code(dtype);
  if (code == QuantCode::kNone || k % kQuantBlock != 0) return {};
  const int bits = quantized_bits(code);
  for (const QuantParams params : {QuantParams::kFloat32, QuantParams::kFloat16,
                                   QuantParams::kScaleFloat16, QuantParams::kScaleFloat32}) {
    if (!quantized_params_allowed(code, params)) continue;
    if (bytes == packed_quantized_weight_size(k, n, bits, kQuantBlock, params)) {
      return {code, params};
    }
  }
  if (code == QuantCode::kInt8 && bytes == packed_quantized_weight_size(k, n, 8, kQuantBlock / 2)) {
    return {QuantCode::kInt8Halves, QuantParams::kFloat32};
  }
  return {};
}

}  // namespace pyengine::detail
