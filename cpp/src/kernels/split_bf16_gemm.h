// The split-bfloat16 GEMM of dense (see pyengine/dense.h): float32 products on
// the CPU's AMX tile unit. Internal to pyengine_core.
//
// A float32 splits exactly into three bfloat16s, x = hi + mid + lo (8 significant bits
// each, rounded to nearest in turn). Of the nine partial products of x * w, the six of
// weight 2^-16 and up (hi hi, hi mid, mid hi, hi lo, mid mid, lo hi) are kept; the three
// dropped ones are below 2^-23 of |x w| together, float32's own rounding of a product. AMX
// multiplies bfloat16 pairs exactly and adds in float32, so the result is as accurate as
// a float32 GEMM's (tests/kernels/test_split_gemm.py checks against float64), and six tile
// products run faster than the float32 multiply-adds they replace where the rows are many.
// (An infinite x or w splits into inf and NaN parts: its products are NaN, not +-inf.)
//
// A packed weight is units of 32 output columns (two halves of 16: columns [32u, 32u +
// 16) and [32u + 16, 32u + 32), or for a gate/up pair gate and up columns [16u, 16u +
// 16)), each [k / 32][half][part hi, mid, lo][16 pairs of k rows][16 columns][2]
// bfloat16s: every (k block, half, part) one 1 KiB B tile of a tile product, k padded
// with zeros to a multiple of 32 and the columns past n zero.
#pragma once

#include <cstdint>

#include "pyengine/tensor_view.h"

namespace pyengine::detail {

inline constexpr int64_t kSplitBlock = 32;  // k rows of one tile product
inline constexpr int64_t kSplitHalf = 16;   // columns of one tile
inline constexpr int64_t kSplitParts = 3;   // hi, mid, lo

// Units of a packed [k, n] weight (gate_up: n gate columns and n up columns).
inline int64_t split_units(int64_t n, bool gate_up) {
  return gate_up ? (n + kSplitHalf - 1) / kSplitHalf : (n + 2 * kSplitHalf - 1) / (2 * kSplitHalf);
}

// bfloat16s of one unit over k rows.
inline int64_t split_unit_size(int64_t k) {
  return (k + kSplitBlock - 1) / kSplitBlock * 2 * kSplitParts * kSplitBlock * kSplitHalf;
}

// out [m, n] = x @ w + bias (bias null: none), w packed as above (`units` of them), out
// rows ldc apart.
void split_bf16_gemm(float* out, int64_t ldc, const float* x, int64_t ldx, int64_t m, int64_t k,
                     const uint16_t* packed, int64_t n, const float* bias);

// out [m, n] = silu(x @ gate) * (x @ up), a gate/up pair packed as above.
void split_bf16_gemm_silu_and_mul(float* out, int64_t ldc, const float* x, int64_t ldx, int64_t m,
                                  int64_t k, const uint16_t* packed, int64_t n);

// Packs w_t [k, n] (gate_up: [k, 2n], gate columns then up) into dst, all
// split_units(n, gate_up) * split_unit_size(k) of it.
void pack_split_bf16(uint16_t* dst, const float* w_t, int64_t ldw, int64_t k, int64_t n,
                     bool gate_up);

}  // namespace pyengine::detail
