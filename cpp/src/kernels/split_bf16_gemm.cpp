// The split-bfloat16 GEMM on AMX (see split_bf16_gemm.h): x splits into three bfloat16
// planes once a call; each 32 x 32 block of the output is four float32 tiles that six
// tile products a k block accumulate, then go out through a sink (bias, or silu * up).
#include "split_bf16_gemm.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "activation.h"
#include "amx_tiles.h"
#include "float_convert.h"

namespace pyengine::detail {
namespace {

constexpr int64_t kTileRows = 16;
constexpr int64_t kBlockRows = 2 * kTileRows;    // rows of x an output block takes
constexpr int64_t kTileBf16 = 16 * 32;           // bfloat16s of one 1 KiB tile
constexpr int64_t kL2Budget = int64_t{1} << 20;  // bytes of x's planes a block of rows keeps

// x [m, k] as three bfloat16 planes, each tile-major: [m_pad / 16][k_pad / 32] tiles of
// [16 rows][32] (rows past m and columns past k zero), 64-byte aligned, so that a tile
// is 1 KiB in one piece and a row tile's k blocks follow one another (what the
// hardware prefetchers follow; rows k_pad apart, the tile loads stalled on L2).
struct SplitRows {
  const uint16_t* parts[kSplitParts];
  int64_t k_pad;
  int64_t m;
  int64_t m_pad;
};

#ifdef PYENGINE_AMX
// GCC 12 takes the intrinsics' undefined pass-through vectors for uninitialized reads.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// Splits row x[0, k) into hi/mid/lo (zeros past k_pad), the row's 32 values of k block b
// at part + b * kTileBf16, rounding to nearest even at each step, as float_to_bf16 does
// (the conversion also takes denormals as zero, which moves only parts below 2^-126).
PYENGINE_AMX_TARGET void split_row(const float* x, int64_t k, int64_t k_pad, uint16_t* hi,
                                   uint16_t* mid, uint16_t* lo) {
  uint16_t* parts[kSplitParts] = {hi, mid, lo};
  for (int64_t i = 0; i < k_pad; i += 16) {
    const int64_t live = std::clamp<int64_t>(k - i, 0, 16);
    __m512 rest = _mm512_maskz_loadu_ps(static_cast<__mmask16>((uint32_t{1} << live) - 1), x + i);
    const int64_t at = i / kSplitBlock * kTileBf16 + i % kSplitBlock;
    for (uint16_t* part : parts) {
      const auto bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(rest));
      _mm256_store_si256(reinterpret_cast<__m256i*>(part + at), bits);
      const __m512 value = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
      rest = _mm512_sub_ps(rest, value);
    }
  }
}

// c [32, 32] (rows 32 floats apart) = rows [r0, r0 + 32) of x times one unit.
PYENGINE_AMX_TARGET void multiply_block(const SplitRows& a, int64_t r0, const uint16_t* unit,
                                        int64_t k_blocks, float* c) {
  const int64_t down = a.k_pad * kTileRows;  // the next row tile
  const uint16_t* hi = a.parts[0] + r0 * a.k_pad;
  const uint16_t* mid = a.parts[1] + r0 * a.k_pad;
  const uint16_t* lo = a.parts[2] + r0 * a.k_pad;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  // Each tile load goes in right after the last product that reads its tile, two
  // products ahead of the first that needs it. (With the tiles in L1 or L2, this order
  // and the plain one, loads then four products, both reach the unit's peak in a
  // microbenchmark: the order costs nothing.)
#define PYENGINE_X(tile, plane, b) \
  _tile_loadd(tile, (plane) + (b)*kTileBf16 + ((tile)-4) * down, 64)
#define PYENGINE_W(tile, part, b) \
  _tile_loadd(tile, unit + ((b)*2 + (tile)-6) * kSplitParts * kTileBf16 + (part)*kTileBf16, 64)
#define PYENGINE_P(c, x, w) _tile_dpbf16ps(c, x, w)
// The four products of the x and w tiles in place, each w tile reloaded with `part` of
// block b once its two products are in.
#define PYENGINE_P4_THEN_W(part, b) \
  PYENGINE_P(0, 4, 6);              \
  PYENGINE_P(2, 5, 6);              \
  PYENGINE_W(6, part, b);           \
  PYENGINE_P(1, 4, 7);              \
  PYENGINE_P(3, 5, 7);              \
  PYENGINE_W(7, part, b);
  if (k_blocks > 0) {  // (k = 0: no tiles to load; the sums stay zero)
    PYENGINE_X(4, hi, 0);
    PYENGINE_X(5, hi, 0);
    PYENGINE_W(6, 0, 0);
    PYENGINE_W(7, 0, 0);
  }
  for (int64_t b = 0; b < k_blocks; ++b) {
    PYENGINE_P4_THEN_W(1, b)  // hi x hi
    PYENGINE_P4_THEN_W(2, b)  // hi x mid
    // hi x lo
    PYENGINE_P(0, 4, 6);
    PYENGINE_P(2, 5, 6);
    PYENGINE_W(6, 1, b);
    PYENGINE_P(1, 4, 7);
    PYENGINE_X(4, mid, b);
    PYENGINE_P(3, 5, 7);
    PYENGINE_X(5, mid, b);
    PYENGINE_W(7, 1, b);
    PYENGINE_P4_THEN_W(0, b)  // mid x mid
    // mid x hi
    PYENGINE_P(0, 4, 6);
    PYENGINE_P(1, 4, 7);
    PYENGINE_X(4, lo, b);
    PYENGINE_P(2, 5, 6);
    PYENGINE_P(3, 5, 7);
    PYENGINE_X(5, lo, b);
    // lo x hi, then the next block's first tiles (mid x lo, lo x mid and lo x lo: dropped)
    const bool next = b + 1 < k_blocks;
    PYENGINE_P(0, 4, 6);
    PYENGINE_P(1, 4, 7);
    if (next) PYENGINE_X(4, hi, b + 1);
    PYENGINE_P(2, 5, 6);
    if (next) PYENGINE_W(6, 0, b + 1);
    PYENGINE_P(3, 5, 7);
    if (next) {
      PYENGINE_X(5, hi, b + 1);
      PYENGINE_W(7, 0, b + 1);
    }
  }
#undef PYENGINE_X
#undef PYENGINE_W
#undef PYENGINE_P
#undef PYENGINE_P4_THEN_W
  _tile_stored(0, c, kBlockRows * 4);
  _tile_stored(1, c + kSplitHalf, kBlockRows * 4);
  _tile_stored(2, c + kTileRows * kBlockRows, kBlockRows * 4);
  _tile_stored(3, c + kTileRows * kBlockRows + kSplitHalf, kBlockRows * 4);
}
#pragma GCC diagnostic pop
#endif  // PYENGINE_AMX

// A 64-byte aligned buffer of bfloat16s, reused by the calling thread.
uint16_t* aligned_scratch(std::vector<uint16_t>& buffer, int64_t size) {
  buffer.resize(static_cast<size_t>(size + 32));
  auto address = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + (-address & 63) / 2;
}

SplitRows split_rows(const float* x, int64_t ldx, int64_t m, int64_t k) {
  const int64_t k_pad = (k + kSplitBlock - 1) / kSplitBlock * kSplitBlock;
  const int64_t m_pad = (m + kBlockRows - 1) / kBlockRows * kBlockRows;
  thread_local std::vector<uint16_t> planes;
  uint16_t* data = aligned_scratch(planes, kSplitParts * m_pad * k_pad);
  SplitRows rows{{data, data + m_pad * k_pad, data + 2 * m_pad * k_pad}, k_pad, m, m_pad};
#ifdef PYENGINE_AMX
  const int64_t plane = m_pad * k_pad;
#pragma omp parallel for if (m * k >= (1 << 15))
  for (int64_t r = 0; r < m_pad; ++r) {
    uint16_t* hi = data + r / kTileRows * kTileRows * k_pad + r % kTileRows * kSplitBlock;
    if (r < m) {
      split_row(x + r * ldx, k, k_pad, hi, hi + plane, hi + 2 * plane);
    } else {
      for (int64_t i = 0; i < kSplitParts * plane; i += plane) {
        for (int64_t b = 0; b < k_pad; b += kSplitBlock) {
          std::fill_n(hi + i + b / kSplitBlock * kTileBf16, kSplitBlock, uint16_t{0});
        }
      }
    }
  }
#else
  (void)x, (void)ldx;
#endif
  return rows;
}

// sink(r0, u, c) for every block of 32 rows and every unit, c [32, 32] the block's
// products (rows 32 floats apart; rows past m are zero). Rows go in blocks whose planes
// stay in L2 while every unit passes over them; threads take units, guided as in
// dense.
template <class Sink>
void for_each_block(const SplitRows& a, const uint16_t* packed, int64_t units, Sink&& sink) {
#ifdef PYENGINE_AMX
  const int64_t k_blocks = a.k_pad / kSplitBlock;
  const int64_t unit_size = k_blocks * 2 * kSplitParts * kTileBf16;
  const int64_t block_rows =
      std::max(kBlockRows, kL2Budget / (kSplitParts * 2 * std::max(a.k_pad, kSplitBlock)) /
                               kBlockRows * kBlockRows);
#pragma omp parallel if (units > 1 && a.m_pad * a.k_pad * units >= (1 << 14))
  {
    const AmxTiles tiles;
    alignas(64) float c[kBlockRows * kBlockRows];
    for (int64_t m0 = 0; m0 < a.m_pad; m0 += block_rows) {
      const int64_t m1 = std::min(a.m_pad, m0 + block_rows);
#pragma omp for schedule(guided, 2) nowait
      for (int64_t u = 0; u < units; ++u) {
        for (int64_t r0 = m0; r0 < m1; r0 += kBlockRows) {
          multiply_block(a, r0, packed + u * unit_size, k_blocks, c);
          sink(r0, u, static_cast<const float*>(c));
        }
      }
    }
  }
#else
  (void)a, (void)packed, (void)units, (void)sink;
#endif
}

}  // namespace

void split_bf16_gemm(float* out, int64_t ldc, const float* x, int64_t ldx, int64_t m, int64_t k,
                     const uint16_t* packed, int64_t n, const float* bias) {
  const SplitRows a = split_rows(x, ldx, m, k);
  for_each_block(a, packed, split_units(n, false), [&](int64_t r0, int64_t u, const float* c) {
    const int64_t first = u * 2 * kSplitHalf, width = std::min(2 * kSplitHalf, n - first);
    for (int64_t r = 0; r < kBlockRows && r0 + r < m; ++r) {
      float* dst = out + (r0 + r) * ldc + first;
      const float* src = c + r * kBlockRows;
      if (bias) {
        for (int64_t j = 0; j < width; ++j) dst[j] = src[j] + bias[first + j];
      } else {
        std::memcpy(dst, src, static_cast<size_t>(width) * sizeof(float));
      }
    }
  });
}

void split_bf16_gemm_silu_and_mul(float* out, int64_t ldc, const float* x, int64_t ldx, int64_t m,
                                  int64_t k, const uint16_t* packed, int64_t n) {
  const SplitRows a = split_rows(x, ldx, m, k);
  for_each_block(a, packed, split_units(n, true), [&](int64_t r0, int64_t u, const float* c) {
    const int64_t first = u * kSplitHalf, width = std::min(kSplitHalf, n - first);
    for (int64_t r = 0; r < kBlockRows && r0 + r < m; ++r) {
      const float* gate = c + r * kBlockRows;
      silu_and_mul_row(gate, gate + kSplitHalf, out + (r0 + r) * ldc + first, width);
    }
  });
}

void pack_split_bf16(uint16_t* dst, const float* w_t, int64_t ldw, int64_t k, int64_t n,
                     bool gate_up) {
  const int64_t units = split_units(n, gate_up), unit_size = split_unit_size(k);
  const int64_t k_blocks = (k + kSplitBlock - 1) / kSplitBlock;
  // Tile by tile, in the packed order (written at random, the tiles' lines took several
  // times longer: a model's load went from 3 to 6 s).
#pragma omp parallel for collapse(2) if (units * k_blocks >= 16)
  for (int64_t u = 0; u < units; ++u) {
    for (int64_t block = 0; block < k_blocks; ++block) {
      for (int64_t half = 0; half < 2; ++half) {
        uint16_t* tiles = dst + u * unit_size + (block * 2 + half) * kSplitParts * kTileBf16;
        // this half's first column of w_t: gate or up columns [16u, 16u + 16), or columns
        // [32u + 16 half, ...)
        const int64_t first = gate_up ? u * kSplitHalf : (2 * u + half) * kSplitHalf;
        const int64_t width = std::clamp<int64_t>(n - first, 0, kSplitHalf);
        const float* src = w_t + (gate_up && half == 1 ? n : 0) + first;
        for (int64_t r = 0; r < kSplitBlock; ++r) {
          const int64_t i = block * kSplitBlock + r;
          uint16_t* pair = tiles + r / 2 * 2 * kSplitHalf + r % 2;
          for (int64_t j = 0; j < kSplitHalf; ++j) {
            float rest = i < k && j < width ? src[i * ldw + j] : 0.0f;
            for (int p = 0; p < kSplitParts; ++p) {
              const uint16_t part = float_to_bf16(rest);
              pair[p * kTileBf16 + 2 * j] = part;
              rest -= bf16_to_float(part);
            }
          }
        }
      }
    }
  }
}

}  // namespace pyengine::detail
