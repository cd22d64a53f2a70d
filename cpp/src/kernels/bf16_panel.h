// The bfloat16 panel of dense (see pyengine/dense.h): its layout, and the products of a
// few rows of bfloat16 x with it. Internal to pyengine_core.
//
// A panel of kPanelWidth columns over k rows is ceil(k / 2) pairs of rows, each
// kPanelWidth lanes of 2 bfloat16s: lane j of pair p holds rows 2p and 2p + 1 of column
// j, the operand of AVX512-BF16's dot product (vdpbf16ps: a lane's pair times a pair of
// x's, added to a float32 sum). A row past k (k odd) and the columns past n are zero.
//
// The products of bfloat16s are exact in float32; each lane's sum adds the pair's odd
// product, then its even one, rounding each time, in pair order: what vdpbf16ps computes,
// and what the portable build computes without it.
#pragma once

#include <cstdint>

#include "pyengine/dense.h"

namespace pyengine::detail {

// Rows of x a tile multiplies at once: 8 rows x 48 columns of sums, 24 AVX-512 registers.
inline constexpr int kBf16TileRows = 8;

// bfloat16s of one panel over k rows.
inline int64_t bf16_panel_size(int64_t k) { return (k + 1) / 2 * 2 * kPanelWidth; }

// Columns [first, first + width) of w_t [k, n] (float32, rows ldw apart), rounded to
// bfloat16 (to nearest, ties to even, as torch converts), as one panel at dst.
void pack_bf16_panel(uint16_t* dst, const float* w_t, int64_t ldw, int64_t k, int64_t first,
                     int64_t width);

// c [rows][kPanelWidth] = a [rows, k] (bfloat16 rows lda apart, k even: a row is read
// in pairs) @ the panel, 1 <= rows <= kBf16TileRows; on AVX512-BF16 where the CPU has it
// and the quantized kernels are not pinned to a narrower build (set_quantized_dense_isa).
void multiply_bf16_rows(const uint16_t* a, int64_t lda, int rows, const uint16_t* panel, int64_t k,
                        float* c);

// Rows of x a tile-unit product multiplies at once (AMX: 16 x 48 sums, three tiles).
inline constexpr int kBf16AmxRows = 16;

// Whether multiply_bf16_block_amx runs here for k: a multiple of 32 (a tile's pairs), on
// the tile unit where amx_tiles_enabled().
bool bf16_amx_takes(int64_t k);

// c [rows][kPanelWidth] = a [rows, k] (bfloat16 rows lda apart) @ the panel, rows a
// multiple of kBf16AmxRows, on AMX (tdpbf16ps: its own order of the sums), in chunks of
// k whose part of the panel stays in L1 while every row tile passes over it; the calling
// thread's tiles configured (AmxTiles), bf16_amx_takes(k).
void multiply_bf16_block_amx(const uint16_t* a, int64_t lda, int64_t rows, const uint16_t* panel,
                             int64_t k, float* c);

// dst[j] = bfloat16(src[j] + bias[j]) (bias null: none; a bfloat16 itself), j < n, each
// rounded to nearest, ties to even, as torch rounds a float32 to bfloat16.
void store_bf16_row(const float* src, const uint16_t* bias, uint16_t* dst, int64_t n);

// dst[r][j] = bfloat16(silu(g) * u) (rows ldd apart), g and u the bfloat16 roundings of
// gate[r][j] and up[r][j] (rows kPanelWidth apart, rows <= kBf16AmxRows, j < n <=
// kPanelWidth): what an unfused product rounded to bfloat16 and silu_and_mul over it give.
void store_bf16_silu_and_mul_rows(const float* gate, const float* up, int64_t rows,
                                  uint16_t* dst, int64_t ldd, int64_t n);

}  // namespace pyengine::detail
