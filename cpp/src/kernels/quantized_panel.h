// The block-quantized panel of dense (see pyengine/dense.h): its byte layout,
// and its widening to the float32 panel the tiles read. Internal to pyengine_core.
//
// A panel of kPanelWidth columns over k rows is k / kQuantBlock blocks, each
//   scale  [kPanelWidth], offset [kPanelWidth] (twice, the first 16 rows' then the last
//          16's, where a block's halves are groups of their own: Q6_K's), float32, or
//          float16 where every one is a float16 exactly (the legacy GGUF types': half
//          the bytes), or float16 scales alone where every offset is zero, or float32
//          scales alone (fp8 weights') (QuantParams),
//   then the block's kQuantBlock rows of integers, in groups of rows a 4-byte lane holds:
//   each group is kPanelWidth lanes, a column's 4 bytes each, so that one 64-byte load is
//   16 columns of a group, the operand of an int8 dot product (vpdpbusd: 4 bytes of a
//   lane times 4 bytes of x) and, shifted, of the widening to float:
//     8-bit: groups of 4 rows, a byte a row: q + 128 (unsigned: vpdpbusd's unsigned
//            side), or an fp8 weight's e4m3 code itself;
//     4-bit: groups of 8 rows: byte b holds row b in its low nibble and row b + 4 in
//            its high one (unsigned, 0..15).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

#include "float_convert.h"
#include "pyengine/dense.h"
#include "pyengine/tensor_view.h"

namespace pyengine::detail {

// Calls f(slot, first_column, width) for each panel of a packed weight of n columns, slot
// being its place in the buffer: panel p at slot p, or, for a gate/up pair (`gate_up`:
// columns [0, n) gate, [n, 2n) up), gate panel p at slot 2p and its up panel at 2p + 1.
// The one layout of pack_weight, pack_gate_up_weight and pack_quantized_weight.
template <class F>
void for_each_packed_panel(int64_t n, bool gate_up, F&& f) {
  const int64_t panels = (n + kPanelWidth - 1) / kPanelWidth;
  // (f writes its slot alone, and the arguments were checked before: the threads split the
  // panels; packing a GGUF's blocks was a third of its load)
#pragma omp parallel for schedule(static) if (panels > 1)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t first = p * kPanelWidth, width = std::min(kPanelWidth, n - first);
    if (gate_up) {
      f(2 * p, first, width);
      f(2 * p + 1, n + first, width);
    } else {
      f(p, first, width);
    }
  }
}

// How a quantized panel codes its weights, from its buffer's dtype: uint8 4-bit nibbles,
// int8 integers, float8_e4m3fn fp8 values (an FP8 checkpoint's; its offsets are zero);
// kNone: not quantized (float32 panels). kInt8Halves: int8 integers whose blocks' halves
// have a scale and offset each (an int8 buffer of that size: quantized_panel_code).
enum class QuantCode : uint8_t { kNone, kNibble, kInt8, kFp8, kInt8Halves };

constexpr QuantCode quant_code(DType packed) {
  switch (packed) {
    case DType::kUInt8: return QuantCode::kNibble;
    case DType::kInt8: return QuantCode::kInt8;
    case DType::kFloat8E4M3: return QuantCode::kFp8;
    default: return QuantCode::kNone;
  }
}

// Bits a weight of a quantized panel: 4 or 8.
constexpr int quantized_bits(QuantCode code) { return code == QuantCode::kNibble ? 4 : 8; }

// Rows of a block that share a scale and offset: 32, or 16 (kInt8Halves).
constexpr int64_t quantized_group_rows(QuantCode code) {
  return code == QuantCode::kInt8Halves ? kQuantBlock / 2 : kQuantBlock;
}

using pyengine::QuantParams;

// A quantized panel's code and parameters.
struct QuantForm {
  QuantCode code = QuantCode::kNone;
  QuantParams params = QuantParams::kFloat32;
};

// Bytes of one group's scales and offsets of a panel.
constexpr int64_t quantized_group_param_bytes(QuantParams params) {
  switch (params) {
    case QuantParams::kFloat32: return 2 * kPanelWidth * 4;
    case QuantParams::kFloat16: return 2 * kPanelWidth * 2;
    case QuantParams::kScaleFloat32: return kPanelWidth * 4;
    default: return kPanelWidth * 2;
  }
}

// Whether the scales are float32s, and whether offsets are stored at all.
constexpr bool quantized_float32_scales(QuantParams params) {
  return params == QuantParams::kFloat32 || params == QuantParams::kScaleFloat32;
}
constexpr bool quantized_offsets_stored(QuantParams params) {
  return params == QuantParams::kFloat32 || params == QuantParams::kFloat16;
}

// The params a code takes: halves' groups float32 only; fp8 weights float32 ones or
// float32 scales alone, and only they the latter. So a buffer's dtype and size tell its
// form apart (quantized_panel_form).
constexpr bool quantized_params_allowed(QuantCode code, QuantParams params) {
  if (code == QuantCode::kInt8Halves) return params == QuantParams::kFloat32;
  if (code == QuantCode::kFp8) return quantized_float32_scales(params);
  return params != QuantParams::kScaleFloat32;
}

// Bytes of one block's scales and offsets, of the whole block, and of a panel over k
// rows, of one panel.
constexpr int64_t quantized_param_bytes(QuantForm form) {
  return kQuantBlock / quantized_group_rows(form.code) * quantized_group_param_bytes(form.params);
}
constexpr int64_t quantized_block_bytes(QuantForm form) {
  return quantized_param_bytes(form) + kQuantBlock * kPanelWidth * quantized_bits(form.code) / 8;
}
constexpr int64_t quantized_panel_bytes(QuantForm form, int64_t k) {
  return k / kQuantBlock * quantized_block_bytes(form);
}

// The form of a quantized buffer of `dtype` and `bytes` for a [k, n] weight, by its size
// (code kNone: no quantized weight of that size).
QuantForm quantized_panel_form(DType dtype, int64_t bytes, int64_t k, int64_t n);

// The scale and offset of row i (within the block), column j, of a block at `block`.
inline const uint8_t* quantized_group_params(const uint8_t* block, int64_t i, QuantForm form) {
  return block + i / quantized_group_rows(form.code) * quantized_group_param_bytes(form.params);
}
inline float quantized_scale(const uint8_t* block, int64_t i, int64_t j, QuantForm form) {
  const uint8_t* params = quantized_group_params(block, i, form);
  if (quantized_float32_scales(form.params)) return reinterpret_cast<const float*>(params)[j];
  return fp16_to_float(reinterpret_cast<const uint16_t*>(params)[j]);
}
// (-0.0 where offsets are not stored: q * scale + -0.0 is q * scale, zeros' signs too)
inline float quantized_offset(const uint8_t* block, int64_t i, int64_t j, QuantForm form) {
  const uint8_t* params = quantized_group_params(block, i, form);
  switch (form.params) {
    case QuantParams::kFloat32: return reinterpret_cast<const float*>(params)[kPanelWidth + j];
    case QuantParams::kFloat16:
      return fp16_to_float(reinterpret_cast<const uint16_t*>(params)[kPanelWidth + j]);
    default: return -0.0f;
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// The scales and offsets of row i's group, columns [16 v, 16 v + 16), as vectors (offsets
// -0.0 where none are stored, as quantized_offset).
__attribute__((target("avx512f,avx512bw"))) inline void load_quantized_params(
    const uint8_t* block, int64_t i, int v, QuantForm form, __m512& scale, __m512& offset) {
  const uint8_t* params = quantized_group_params(block, i, form);
  if (quantized_float32_scales(form.params)) {
    scale = _mm512_loadu_ps(reinterpret_cast<const float*>(params) + 16 * v);
    offset = form.params == QuantParams::kFloat32
                 ? _mm512_loadu_ps(reinterpret_cast<const float*>(params) + kPanelWidth + 16 * v)
                 : _mm512_set1_ps(-0.0f);
    return;
  }
  const auto* halves = reinterpret_cast<const uint16_t*>(params);
  scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves + 16 * v)));
  offset = form.params == QuantParams::kFloat16
               ? _mm512_cvtph_ps(_mm256_loadu_si256(
                     reinterpret_cast<const __m256i*>(halves + kPanelWidth + 16 * v)))
               : _mm512_set1_ps(-0.0f);
}
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// The same for columns [8 v, 8 v + 8), AVX2's width.
__attribute__((target("avx2,fma,f16c"))) inline void load_quantized_params8(
    const uint8_t* block, int64_t i, int v, QuantForm form, __m256& scale, __m256& offset) {
  const uint8_t* params = quantized_group_params(block, i, form);
  if (quantized_float32_scales(form.params)) {
    const auto* floats = reinterpret_cast<const float*>(params) + 8 * v;
    scale = _mm256_loadu_ps(floats);
    offset = form.params == QuantParams::kFloat32 ? _mm256_loadu_ps(floats + kPanelWidth)
                                                  : _mm256_set1_ps(-0.0f);
    return;
  }
  const auto* halves = reinterpret_cast<const uint16_t*>(params) + 8 * v;
  scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves)));
  offset = form.params == QuantParams::kFloat16
               ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + kPanelWidth)))
               : _mm256_set1_ps(-0.0f);
}
#endif

// Rows of a block a 4-byte lane of its integers holds: 8 nibbles, or 4 bytes.
constexpr int quantized_lane_rows(QuantCode code) { return code == QuantCode::kNibble ? 8 : 4; }

// Whether the code's bytes are integers stored plus 128.
constexpr bool quantized_biased(QuantCode code) {
  return code == QuantCode::kInt8 || code == QuantCode::kInt8Halves;
}

// The byte of row i (within the block), column j, of a block's integers, and the shift
// of its nibble (4-bit).
inline int64_t quantized_byte(int64_t i, int64_t j, QuantCode code) {
  return (i / quantized_lane_rows(code) * kPanelWidth + j) * 4 + i % 4;
}
inline int quantized_nibble_shift(int64_t i) { return static_cast<int>(i % 8 / 4 * 4); }

// q of row i (within the block), column j, of a block's integers at `ints`, as float
// (exactly: a small integer, or an fp8 value).
inline float quantized_value(const uint8_t* ints, int64_t i, int64_t j, QuantCode code) {
  const uint8_t byte = ints[quantized_byte(i, j, code)];
  switch (code) {
    case QuantCode::kInt8:
    case QuantCode::kInt8Halves: return static_cast<float>(static_cast<int>(byte) - 128);
    case QuantCode::kFp8: return fp8_e4m3_to_float(byte);
    default: return static_cast<float>(byte >> quantized_nibble_shift(i) & 15);
  }
}

// q of row b (of the lane rows) of a lane's 4 bytes, a biased code's bias flipped off
// (lane ^ 0x80808080), as float: the portable builds' widening of one weight.
template <QuantCode kCode>
inline float quantized_lane_value(uint32_t lane, int b) {
  if constexpr (kCode == QuantCode::kNibble) {
    return static_cast<float>(lane >> (8 * (b % 4) + 4 * (b / 4)) & 15);
  } else if constexpr (kCode == QuantCode::kFp8) {
    return fp8_e4m3_to_float(static_cast<uint8_t>(lane >> 8 * b));
  } else {  // (sign-extended from the row's byte)
    return static_cast<float>(static_cast<int32_t>(lane << (24 - 8 * b)) >> 24);
  }
}

// The quantized rows of a block are read once, in order: ask for them 4 blocks ahead
// (past the panel, into the thread's next one; prefetches never fault).
inline void prefetch_quantized_ahead(const uint8_t* block, int64_t block_bytes) {
  const uint8_t* ahead = block + 4 * block_bytes;
  for (int64_t line = 0; line < block_bytes; line += 64) __builtin_prefetch(ahead + line, 0, 1);
}

// The float32 panel [k, kPanelWidth] of the quantized panel at src: q * scale + offset,
// rounded once (q * scale is exact, or the offset zero).
void widen_quantized_panel(const uint8_t* src, int64_t k, QuantForm form, float* dst);

// Rows a decode step multiplies with the weights widened in registers, not through a
// widened chunk in L1 (whose stores and loads cost a few rows as much as the products).
// AVX-512's 32 registers hold the sums of kWideRegisterRows (a verifying step's token and
// its drafts), the other builds' of kRegisterRows.
inline constexpr int kRegisterRows = 4;
inline constexpr int kWideRegisterRows = 6;

// f(std::integral_constant<QuantCode, code>): a kernel built for each code, picked once.
template <class F>
decltype(auto) with_quant_code(QuantCode code, F&& f) {
  switch (code) {
    case QuantCode::kNibble: return f(std::integral_constant<QuantCode, QuantCode::kNibble>{});
    case QuantCode::kFp8: return f(std::integral_constant<QuantCode, QuantCode::kFp8>{});
    case QuantCode::kInt8Halves:
      return f(std::integral_constant<QuantCode, QuantCode::kInt8Halves>{});
    default: return f(std::integral_constant<QuantCode, QuantCode::kInt8>{});
  }
}

// f(std::integral_constant<int, rows>) for 1 <= rows <= kMax (larger: kMax): the few-row
// kernels, whose sums are registers of a compile-time count.
template <int kMax = kRegisterRows, class F>
decltype(auto) with_register_rows(int rows, F&& f) {
  static_assert(kMax >= 1);
  if constexpr (kMax == 1) {
    return f(std::integral_constant<int, 1>{});
  } else {
    if (rows >= kMax) return f(std::integral_constant<int, kMax>{});
    return with_register_rows<kMax - 1>(rows, std::forward<F>(f));
  }
}

// Whether quantized panels are widened with AVX-512: on CPUs with it, unless pinned to
// another build (set_quantized_dense_isa).
bool quantized_avx512();

// The most rows multiply_quantized_rows takes in the build in use.
inline int quantized_register_rows() {
  return quantized_avx512() ? kWideRegisterRows : kRegisterRows;
}

// c [rows][kPanelWidth] = a [rows, k] (lda apart) @ the quantized panel at `panel`, for
// 1 <= rows <= quantized_register_rows(), each weight widened in registers exactly as
// widen_quantized_panel widens it, and the sums in the order of dense's float32 tiles
// (one row: the even and the odd k in two chains), so the result is theirs bit for bit.
void multiply_quantized_rows(const float* a, int64_t lda, int rows, const uint8_t* panel,
                             int64_t k, QuantForm form, float* c);

// The portable build of multiply_quantized_rows (quantized_rows_portable.cpp), for
// code's panels.
template <QuantCode kCode>
void multiply_rows_portable(const float* a, int64_t lda, int rows, const uint8_t* panel,
                            int64_t k, QuantParams params, float* c);

// A decode step's rows of x, quantized for integer products with quantized panels (as
// llama.cpp's q8_0 activations): each block of kQuantBlock values of a row as
// xq = round(x / d), d = max|x| / 127, with the sums a panel's offsets and its unsigned
// int8 bytes need. Quantized once a call, read by every thread.
struct Int8Rows {
  std::vector<int8_t> q;         // [rows, k]
  std::vector<float> scale;      // [rows, k / kQuantBlock]: d (0 for a block of zeros)
  std::vector<float> sum;        // [rows, k / 16]: the sum of x over each 16 values
  std::vector<int32_t> int_sum;  // [rows, k / 16]: the sum of xq over each 16
  int64_t k = 0;

  // rows of a (lda apart) of k values, k a multiple of kQuantBlock.
  void quantize(const float* a, int64_t lda, int64_t rows, int64_t k);
};

// Whether a panel of `code` multiplies by Int8Rows (not fp8's).
constexpr bool int8_rows_multiply(QuantCode code) {
  return code == QuantCode::kNibble || quantized_biased(code);
}

// c [rows][kPanelWidth] = rows [r0, r0 + rows) of x times the quantized panel at `panel`
// (of x.k rows), 1 <= rows <= kRegisterRows, code one int8_rows_multiply takes: per group
// of a panel, the exact int32 sum of q * xq, then sum = fma(sum_q_xq, scale * d, sum) and
// sum = fma(offset, sum of x, sum) (where offsets are stored), in float32, the same in
// every build (VNNI's and the portable one).
void multiply_int8_rows(const Int8Rows& x, int64_t r0, int rows, const uint8_t* panel,
                        QuantForm form, float* c);

}  // namespace pyengine::detail
