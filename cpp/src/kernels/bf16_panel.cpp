// The bfloat16 panels' products (see bf16_panel.h): vdpbf16ps where the CPU has
// AVX512-BF16, else the same sums from bfloat16s widened in registers.
#include "bf16_panel.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

#include "activation.h"
#include "amx_tiles.h"
#include "float_convert.h"
#include "quantized_panel.h"
#include "vector_clones.h"

namespace pyengine::detail {
namespace {

constexpr int kLanes = 16;
constexpr int kVectors = kPanelWidth / kLanes;
constexpr int64_t kPairElements = 2 * kPanelWidth;  // bfloat16s of one pair of rows

// The pair of x's row at column 2p, as the 32 bits a lane holds.
inline uint32_t pair_at(const uint16_t* row, int64_t p) {
  uint32_t pair;
  std::memcpy(&pair, row + 2 * p, sizeof pair);
  return pair;
}

// f(std::integral_constant<int, rows>) for 1 <= rows <= kBf16TileRows.
template <class F>
void with_tile_rows(int rows, F&& f) {
  static_assert(kBf16TileRows == 8);
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// 16 floats (a zmm) where the CPU has AVX-512, else 8 (a ymm): GCC lowers a vector wider
// than a clone's registers through the stack, element by element.
using Vec16 = float __attribute__((vector_size(64)));
using Bits16 = uint32_t __attribute__((vector_size(64)));
using Vec8 = float __attribute__((vector_size(32)));
using Bits8 = uint32_t __attribute__((vector_size(32)));

// The portable build: each lane's pair widened to two floats (a bfloat16 is a float's
// high half), the odd product added first, as vdpbf16ps adds them. (Products of
// bfloat16s are exact: a fused multiply-add rounds as the separate add does, and every
// vector width gives the same bits.) kSets sums of alternate pairs, added at the end, as
// the dot-product build keeps them for a tile of one row.
template <class V, class B, int kRows, int kSets>
PYENGINE_VECTOR_CLONES void tile_portable_of(const uint16_t* a, int64_t lda, const uint16_t* panel,
                                             int64_t pairs, float* c) {
  constexpr int kL = static_cast<int>(sizeof(V) / sizeof(float)), kV = kPanelWidth / kL;
  V sets[kSets][kRows][kV] = {};
  for (int64_t p = 0; p < pairs; ++p) {
    auto& acc = sets[p % kSets];
    const uint16_t* lanes = panel + p * kPairElements;
    float x_even[kRows], x_odd[kRows];
    for (int r = 0; r < kRows; ++r) {
      const uint32_t pair = pair_at(a + r * lda, p);
      x_even[r] = bits_to_float(pair << 16);
      x_odd[r] = bits_to_float(pair & 0xFFFF0000u);
    }
#pragma GCC unroll 6
    for (int v = 0; v < kV; ++v) {
      B w;
      std::memcpy(&w, lanes + 2 * kL * v, sizeof w);
      const V even = reinterpret_cast<V>(w << 16), odd = reinterpret_cast<V>(w & 0xFFFF0000u);
      for (int r = 0; r < kRows; ++r) {
        acc[r][v] += x_odd[r] * odd;
        acc[r][v] += x_even[r] * even;
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kV; ++v) {
      V sum = sets[0][r][v];
      if constexpr (kSets == 2) sum += sets[1][r][v];
      std::memcpy(c + r * kPanelWidth + v * kL, &sum, sizeof(V));
    }
  }
}

// A tile of one row (a decode step's) keeps two sets of sums, even and odd pairs, in
// every build (the dot products' latency hidden), and so adds in one order everywhere.
template <int kRows>
constexpr int kTileSets = kRows == 1 ? 2 : 1;

// kRows rows at once in 16-float vectors; in 8-float ones, passes of 2 rows (12 sums in
// AVX2's 16 registers).
template <int kRows>
void tile_portable(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t pairs, float* c) {
  constexpr int kSets = kTileSets<kRows>;
  if (wide_vectors()) {
    return tile_portable_of<Vec16, Bits16, kRows, kSets>(a, lda, panel, pairs, c);
  }
  for (int r = 0; r + 1 < kRows; r += 2) {
    tile_portable_of<Vec8, Bits8, 2, kSets>(a + r * lda, lda, panel, pairs, c + r * kPanelWidth);
  }
  if constexpr (kRows % 2 == 1) {
    tile_portable_of<Vec8, Bits8, 1, kSets>(a + (kRows - 1) * lda, lda, panel, pairs,
                                            c + (kRows - 1) * kPanelWidth);
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PYENGINE_BF16_DOT 1

bool bf16_dot_supported() {
  static const bool supported = __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512bf16");
  return supported;
}

// The panel's stream is read once by the block's first tile: asked for this many pairs
// ahead (3 cache lines a pair), into L2.
constexpr int64_t kPrefetchPairs = 24;

// One row (a decode step's) keeps two sets of sums (kTileSets), even and odd pairs, so
// that the dot products' latency is hidden; more rows are chains enough.
template <int kRows>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void tile_bf16_dot(const uint16_t* a,
                                                                          int64_t lda,
                                                                          const uint16_t* panel,
                                                                          int64_t pairs, float* c) {
  constexpr int kSets = kTileSets<kRows>;
  __m512 acc[kSets][kRows][kVectors];
  for (auto& set : acc) {
    for (auto& row : set) {
      for (auto& v : row) v = _mm512_setzero_ps();
    }
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* lanes = panel + p * kPairElements;
    const uint16_t* ahead = lanes + kPrefetchPairs * kPairElements;
    for (int line = 0; line < kVectors; ++line) __builtin_prefetch(ahead + 32 * line, 0, 1);
    auto& sums = acc[p % kSets];
    __m512bh w[kVectors];
    for (int v = 0; v < kVectors; ++v) {
      w[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(lanes + 32 * v));
    }
    for (int r = 0; r < kRows; ++r) {
      const auto x = reinterpret_cast<__m512bh>(
          _mm512_set1_epi32(static_cast<int32_t>(pair_at(a + r * lda, p))));
      for (int v = 0; v < kVectors; ++v) sums[r][v] = _mm512_dpbf16_ps(sums[r][v], w[v], x);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVectors; ++v) {
      __m512 sum = acc[0][r][v];
      if constexpr (kSets == 2) sum = _mm512_add_ps(sum, acc[1][r][v]);
      _mm512_storeu_ps(c + r * kPanelWidth + kLanes * v, sum);
    }
  }
}
#endif

constexpr int64_t kAmxPairs = kAmxTileBytes / 4;  // pairs of k rows of one tile product
// Pairs of k rows of a chunk: the chunk's 24 KiB of the panel stay in L1 while every row
// tile of the block passes over it (their sums kept in `c` between chunks), so that only
// x's tiles come from L2. (Each row tile over the whole k, reading 3 KiB of the panel from
// L2 for every 1 KiB of x, ran 1.07-1.25x slower on a Llama-3.2-1B shape's prefill
// matmuls; chunks of 64 or 256 pairs were no faster.)
constexpr int64_t kAmxChunkPairs = 128;
// How far ahead, in tile products (16 pairs each), lines are asked for: the streaming
// tile's panel lines into L1, x's next tile into L1, and every tile's share of the panel
// lines far ahead into L2, so that memory stays busy while the tiles after the first
// multiply from L1. (Against asking only 4 products ahead, decode steps of 32 rows over
// a Llama-3.2-1B shape's weights took 10% less time, one process, best of 3.)
constexpr int64_t kAmxPrefetchSteps = 4;
constexpr int64_t kAmxXAhead = 2;
constexpr int64_t kAmxFarSteps = 16;

#ifdef PYENGINE_AMX
// Tiles 0-2 += x's 16 rows (lda apart) @ pairs [p0, p1) of the panel: tile 3 x's 16 rows x
// 16 pairs, 4-6 the panel's three 16-column thirds' B tiles (16 pairs of lanes, a pair's
// lanes 192 bytes apart). kStream: the pass that reads the chunk from memory, which asks
// for the panel's lines kAmxPrefetchSteps tile products ahead (past the chunk too); lines
// [far_first, far_last) of each product's kAmxFarSteps ahead: this tile's share.
template <bool kStream>
PYENGINE_AMX_TARGET inline void tile_amx(const uint16_t* x, int64_t lda, const uint16_t* panel,
                                         int64_t p0, int64_t p1, const char* end,
                                         int64_t far_first, int64_t far_last) {
  constexpr int64_t kPairBytes = kPairElements * 2;
  constexpr int64_t kStepLines = kAmxPairs * kPairBytes / 64;
  for (int64_t p = p0; p < p1; p += kAmxPairs) {
    const uint16_t* lanes = panel + p * kPairElements;
    const char* step = reinterpret_cast<const char*>(lanes);
    if constexpr (kStream) {
      const char* ahead = step + kAmxPrefetchSteps * kAmxPairs * kPairBytes;
      for (int64_t line = 0; line < kStepLines && ahead + 64 * line < end; ++line) {
        _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
      }
    }
    const char* far = step + kAmxFarSteps * kAmxPairs * kPairBytes;
    for (int64_t line = far_first; line < far_last && far + 64 * line < end; ++line) {
      _mm_prefetch(far + 64 * line, _MM_HINT_T2);
    }
    if (p + kAmxXAhead * kAmxPairs < p1) {  // x's tile two products ahead, into L1
      const uint16_t* next_x = x + 2 * (p + kAmxXAhead * kAmxPairs);
      for (int r = 0; r < kAmxTileRows; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(next_x + r * lda), _MM_HINT_T0);
      }
    }
    _tile_loadd(3, x + 2 * p, lda * 2);
    _tile_loadd(4, lanes, kPairBytes);
    _tile_loadd(5, lanes + 2 * kLanes, kPairBytes);
    _tile_loadd(6, lanes + 4 * kLanes, kPairBytes);
    _tile_dpbf16ps(0, 3, 4);
    _tile_dpbf16ps(1, 3, 5);
    _tile_dpbf16ps(2, 3, 6);
  }
}

// c [rows][kPanelWidth] = a's rows (rows a multiple of 16) @ the panel: for each chunk of
// pairs, each 16-row tile's sums (tiles 0-2, the panel's thirds) loaded from c (zero at
// the first chunk), multiplied over the chunk (tile_amx), stored back. float32 sums
// stored and loaded exactly: the same sums as one pass over k.
PYENGINE_AMX_TARGET void block_amx(const uint16_t* a, int64_t lda, int64_t rows,
                                   const uint16_t* panel, int64_t pairs, float* c) {
  constexpr int64_t kRowBytes = kPanelWidth * 4;
  constexpr int64_t kStepLines = kAmxPairs * kPairElements * 2 / 64;
  const auto* end = reinterpret_cast<const char*>(panel + pairs * kPairElements);
  for (int64_t p0 = 0; p0 < pairs; p0 += kAmxChunkPairs) {
    const int64_t p1 = std::min(pairs, p0 + kAmxChunkPairs);
    for (int64_t r0 = 0; r0 < rows; r0 += kAmxTileRows) {
      float* sums = c + r0 * kPanelWidth;
      if (p0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
      } else {
        _tile_loadd(0, sums, kRowBytes);
        _tile_loadd(1, sums + kLanes, kRowBytes);
        _tile_loadd(2, sums + 2 * kLanes, kRowBytes);
      }
      const int64_t far_first = r0 * kStepLines / rows;
      const int64_t far_last = (r0 + kAmxTileRows) * kStepLines / rows;
      if (r0 == 0) {
        tile_amx<true>(a, lda, panel, p0, p1, end, far_first, far_last);
      } else {
        tile_amx<false>(a + r0 * lda, lda, panel, p0, p1, end, far_first, far_last);
      }
      _tile_stored(0, sums, kRowBytes);
      _tile_stored(1, sums + kLanes, kRowBytes);
      _tile_stored(2, sums + 2 * kLanes, kRowBytes);
    }
  }
}
#endif

}  // namespace

bool bf16_amx_takes(int64_t k) { return k % (2 * kAmxPairs) == 0 && amx_tiles_enabled(); }

void multiply_bf16_block_amx(const uint16_t* a, int64_t lda, int64_t rows, const uint16_t* panel,
                             int64_t k, float* c) {
#ifdef PYENGINE_AMX
  block_amx(a, lda, rows, panel, k / 2, c);
#else
  (void)a, (void)lda, (void)rows, (void)panel, (void)k, (void)c;
#endif
}

void pack_bf16_panel(uint16_t* dst, const float* w_t, int64_t ldw, int64_t k, int64_t first,
                     int64_t width) {
  std::fill(dst, dst + bf16_panel_size(k), uint16_t{0});
  for (int64_t i = 0; i < k; ++i) {
    uint16_t* pair = dst + i / 2 * kPairElements + i % 2;
    const float* row = w_t + i * ldw + first;
    for (int64_t j = 0; j < width; ++j) pair[2 * j] = float_to_bf16(row[j]);
  }
}

void multiply_bf16_rows(const uint16_t* a, int64_t lda, int rows, const uint16_t* panel, int64_t k,
                        float* c) {
  const int64_t pairs = k / 2;
  const bool dot = bf16_dot_product();
  (void)dot;  // (no AVX512-BF16 build on other compilers)
  with_tile_rows(rows, [&](auto r) {
    constexpr int kRows = decltype(r)::value;
#ifdef PYENGINE_BF16_DOT
    if (dot) return tile_bf16_dot<kRows>(a, lda, panel, pairs, c);
#endif
    tile_portable<kRows>(a, lda, panel, pairs, c);
  });
}

PYENGINE_VECTOR_CLONES
void store_bf16_row(const float* src, const uint16_t* bias, uint16_t* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    dst[j] = float_to_bf16(bias != nullptr ? src[j] + bf16_to_float(bias[j]) : src[j]);
  }
}

// (GCC 12 cannot see the loop below write all that silu_and_mul_row reads.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
PYENGINE_VECTOR_CLONES
void store_bf16_silu_and_mul_rows(const float* gate, const float* up, int64_t rows, uint16_t* dst,
                                  int64_t ldd, int64_t n) {
  // Whole rows of the panel (columns past n are zero sums) in one pass of silu_and_mul.
  constexpr int64_t kMost = kBf16AmxRows * kPanelWidth;
  float g[kMost], u[kMost], out[kMost];
  const int64_t count = rows * kPanelWidth;
  for (int64_t j = 0; j < count; ++j) {
    g[j] = bf16_to_float(float_to_bf16(gate[j]));
    u[j] = bf16_to_float(float_to_bf16(up[j]));
  }
  silu_and_mul_row(g, u, out, count);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; ++j) dst[r * ldd + j] = float_to_bf16(out[r * kPanelWidth + j]);
  }
}
#pragma GCC diagnostic pop

}  // namespace pyengine::detail

namespace pyengine {

bool bf16_dot_product() {
#ifdef PYENGINE_BF16_DOT
  return detail::quantized_avx512() && detail::bf16_dot_supported();
#else
  return false;
#endif
}

}  // namespace pyengine
