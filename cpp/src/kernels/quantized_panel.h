// The block-quantized panel of dense (see pyengine/dense.h): its byte layout,
// and its widening to the float32 panel the tiles read. Internal to pyengine_core.
//
// A panel of kPanelWidth columns over k rows is k / kQuantBlock blocks, each
//   scale  [kPanelWidth] float32, offset [kPanelWidth] float32 (twice, the first 16 rows'
//          then the last 16's, where a block's halves are groups of their own: Q6_K's),
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
#include <vector>

#include "float_convert.h"
#include "pyengine/dense.h"
#include "pyengine/tensor_view.h"

namespace pyengine::detail {

inline constexpr int64_t kQuantParamBytes = 2 * kPanelWidth * sizeof(float);

// Calls f(slot, first_column, width) for each panel of a packed weight of n columns, slot
// being its place in the buffer: panel p at slot p, or, for a gate/up pair (`gate_up`:
// columns [0, n) gate, [n, 2n) up), gate panel p at slot 2p and its up panel at 2p + 1.
// The one layout of pack_weight, pack_gate_up_weight and pack_quantized_weight.
template <class F>
void for_each_packed_panel(int64_t n, bool gate_up, F&& f) {
  for (int64_t p = 0; p * kPanelWidth < n; ++p) {
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

// Bytes of one block's scales and offsets, and of the whole block, of one panel.
constexpr int64_t quantized_param_bytes(QuantCode code) {
  return kQuantBlock / quantized_group_rows(code) * kQuantParamBytes;
}
constexpr int64_t quantized_block_bytes(QuantCode code) {
  return quantized_param_bytes(code) + kQuantBlock * kPanelWidth * quantized_bits(code) / 8;
}

// The code of a quantized buffer of `dtype` and `bytes` for a [k, n] weight: an int8 one
// of halves' size holds kInt8Halves (kNone: no quantized weight of that size).
QuantCode quantized_panel_code(DType dtype, int64_t bytes, int64_t k, int64_t n);

// The scale (offset: + kPanelWidth) of row i of a block at `block`, column 0.
inline const float* quantized_params(const uint8_t* block, int64_t i, QuantCode code) {
  return reinterpret_cast<const float*>(block) + i / quantized_group_rows(code) * 2 * kPanelWidth;
}

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

// The float32 panel [k, kPanelWidth] of the quantized panel at src: q * scale + offset,
// rounded once (q * scale is exact, or the offset zero).
void widen_quantized_panel(const uint8_t* src, int64_t k, QuantCode code, float* dst);

// Rows a decode step multiplies with the weights widened in registers, not through a
// widened chunk in L1 (whose stores and loads cost a few rows as much as the products).
inline constexpr int kRegisterRows = 4;

// Whether quantized panels are widened with AVX-512 (and few rows multiplied in
// registers): on CPUs with it, unless pinned to another build (set_quantized_dense_isa).
bool quantized_avx512();

// c [rows][kPanelWidth] = a [rows, k] (lda apart) @ the quantized panel at `panel`, for
// 1 <= rows <= kRegisterRows, each weight widened in registers exactly as
// widen_quantized_panel widens it, and the sums in the order of dense's float32 tiles
// (one row: the even and the odd k in two chains), so the result is theirs bit for bit.
void multiply_quantized_rows(const float* a, int64_t lda, int rows, const uint8_t* panel,
                             int64_t k, QuantCode code, float* c);

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
// sum = fma(offset, sum of x, sum), in float32, the same in every build (VNNI's and the
// portable one).
void multiply_int8_rows(const Int8Rows& x, int64_t r0, int rows, const uint8_t* panel,
                        QuantCode code, float* c);

}  // namespace pyengine::detail
