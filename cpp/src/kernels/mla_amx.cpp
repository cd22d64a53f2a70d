// MLA attention on AMX, a chunk of up to 256 keys at a time. First the chunk's scores:
// two 16-key tiles of the latent cache (A, rows a cache row apart) against the heads'
// queries packed as B pairs give them transposed (keys x heads), a vector per key holding
// every head's score, so that the online softmax is 16 heads a lane (mla_lanes.h, its
// reference moved once a chunk at most). Then its values, straight from the cache rows
// as B (each row's 32 columns a tile row, as pairs of neighbouring columns) against the
// weights as A twice: a head's row holds its weight of key k in the low half of dword k
// (the even columns' product) or in the high half (the odd ones'), so that no row is
// interleaved with another. The float sums of 64 columns stay in four tiles across the
// chunk's keys. The chunk's rows, read once from memory for the scores, are in L2 for the
// values. Keys outside [begin, end) get no weight; rows past `end` are taken as zeros.
#include "mla_lanes.h"

#include <algorithm>
#include <vector>

#include "amx_tiles.h"

namespace pyengine::detail {

bool mla_amx_fits(const MlaTile& s) { return amx_tiles_enabled() && mla_lanes_fit(s); }

#ifdef PYENGINE_AMX
namespace {

constexpr int kChunk = 256;  // keys whose scores are taken before their values
constexpr int kTiles = kChunk / 16;

// The sums' columns back in order: the even columns of 32 were kept first, the odd ones
// after (out[2i] = stored[i], out[2i + 1] = stored[16 + i]).
PYENGINE_AMX_TARGET inline void columns_from_halves(const float* totals, int64_t heads,
                                                    int64_t v, float* acc) {
  alignas(64) int32_t low[16], high[16];
  for (int j = 0; j < 16; ++j) {
    low[j] = j / 2 + (j % 2) * 16;
    high[j] = 8 + j / 2 + (j % 2) * 16;
  }
  const __m512i first = _mm512_load_si512(low), second = _mm512_load_si512(high);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t c = 0; c < v; c += 32) {
      const float* stored = totals + h * v + c;
      const __m512 even = _mm512_loadu_ps(stored), odd = _mm512_loadu_ps(stored + 16);
      _mm512_storeu_ps(acc + h * v + c, _mm512_permutex2var_ps(even, first, odd));
      _mm512_storeu_ps(acc + h * v + c + 16, _mm512_permutex2var_ps(even, second, odd));
    }
  }
}

// rows[p][h] -> rows[h][p] for 16 rows of 16 dwords: pairs, then quads, then 128-bit
// lanes, then their pairs (after the second stage, lane L of row 4i + j holds rows
// 4i..4i+3 of column 4L + j).
PYENGINE_AMX_TARGET inline void transpose_dwords(__m512i rows[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8) {
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(u[i + j], u[i + 4 + j], 0x88);
      t[i + 4 + j] = _mm512_shuffle_i32x4(u[i + j], u[i + 4 + j], 0xDD);
    }
  }
  for (int j = 0; j < 8; ++j) {
    rows[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    rows[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xDD);
  }
}

}  // namespace

PYENGINE_AMX_TARGET void attend_amx(const MlaTile& s, const uint16_t* q, const uint16_t* cache,
                                    const int32_t* table, int64_t begin, int64_t end, float scale,
                                    float* acc, float* max, float* sum) {
  const int64_t d = s.latent, v = s.value, row_bytes = d * 2;
  thread_local std::vector<uint16_t> qv, tail_rows;
  thread_local std::vector<float> sums16;
  pack_queries(q, s.heads, d, qv);  // (B pairs)
  tail_rows.resize(static_cast<size_t>(16 * d));
  sums16.assign(static_cast<size_t>(16 * v), 0.0f);  // every tile row's (16 heads)
  // (local pointers: a thread_local's address is a call away in a shared library)
  const uint16_t* queries = qv.data();
  uint16_t* tail = tail_rows.data();
  float* totals = sums16.data();
  LaneSoftmax softmax;
  alignas(64) float tile_scores[kTiles][16 * 16];
  alignas(64) uint32_t even[kTiles][16 * 16], odd[kTiles][16 * 16];  // A: heads x keys
  const uint16_t* rows[kTiles];
  __m512 scores[kChunk];
  __m256i rounded[kChunk];
  for (int64_t chunk = begin - begin % 16; chunk < end; chunk += kChunk) {
    const int tiles = static_cast<int>(std::min<int64_t>(kTiles, (end - chunk + 15) / 16));
    for (int t = 0; t < tiles; ++t) {
      const int64_t first = chunk + 16 * t;
      rows[t] = key_rows(s, cache, table, first, end);
      if (first + 16 > end) {  // (the rows past the end may hold anything: zeros instead)
        const int64_t n = end - first;
        std::copy_n(rows[t], n * d, tail);
        std::fill(tail + n * d, tail + 16 * d, uint16_t{0});
        rows[t] = tail;
      }
    }
    // The scores, two tiles at a time: tiles 0 and 1 [16 keys][16 heads].
    for (int t = 0; t < tiles; t += 2) {
      const bool two = t + 1 < tiles;
      _tile_zero(0);
      _tile_zero(1);
      // The rows two tiles on (two runs of 16 rows, each contiguous in its block) asked
      // for into L2, 16 lines of each run a column tile, so that their misses overlap
      // this work (the blocks lie anywhere in the pool; from memory it gains little, from
      // L3 a tenth).
      const int64_t next = chunk + 16 * t + 32;
      const uint16_t* near[2] = {
          next + 16 <= end ? key_rows(s, cache, table, next, end) : nullptr,
          next + 32 <= end ? key_rows(s, cache, table, next + 16, end) : nullptr};
      for (int64_t c = 0; c < d; c += 32) {
        for (const uint16_t* run : near) {
          if (run == nullptr) continue;
          const char* slice = reinterpret_cast<const char*>(run) + c * 32;  // (16 rows' lines)
          for (int line = 0; line < 16; ++line) _mm_prefetch(slice + line * 64, _MM_HINT_T1);
        }
        _tile_loadd(2, queries + c * 16, 64);
        _tile_loadd(3, rows[t] + c, row_bytes);
        _tile_dpbf16ps(0, 3, 2);
        if (two) {
          _tile_loadd(4, rows[t + 1] + c, row_bytes);
          _tile_dpbf16ps(1, 4, 2);
        }
      }
      _tile_stored(0, tile_scores[t], 64);
      if (two) _tile_stored(1, tile_scores[t + 1], 64);
    }
    const int n = tiles * 16;
    for (int k = 0; k < n; ++k) scores[k] = _mm512_load_ps(tile_scores[k / 16] + k % 16 * 16);
    __m512 correction;
    const __mmask16 moves = softmax.step(scores, n, chunk, begin, end, scale, correction);
    if (moves != 0) rescale_heads(totals, v, moves, correction);
    softmax.weights(scores, n, rounded);
    // The weights as A, transposed to heads x keys in registers: a dword a key.
    for (int t = 0; t < tiles; ++t) {
      __m512i w[16];
      for (int k = 0; k < 16; ++k) w[k] = _mm512_cvtepu16_epi32(rounded[16 * t + k]);
      transpose_dwords(w);
      for (int h = 0; h < 16; ++h) {
        _mm512_store_si512(even[t] + h * 16, w[h]);
        _mm512_store_si512(odd[t] + h * 16, _mm512_slli_epi32(w[h], 16));
      }
    }
    // The values, 64 columns at a time (32 where 32 are left): sums in tiles 4-7, the
    // weights in 0 and 1, the rows' columns in 2 and 3.
    for (int64_t c = 0; c < v; c += 64) {
      const bool two = c + 64 <= v;
      _tile_loadd(6, totals + c, v * 4);  // (even columns of c..c+32, then odd)
      _tile_loadd(7, totals + c + 16, v * 4);
      if (two) {
        _tile_loadd(4, totals + c + 32, v * 4);
        _tile_loadd(5, totals + c + 48, v * 4);
      }
      for (int t = 0; t < tiles; ++t) {
        _tile_loadd(0, even[t], 64);
        _tile_loadd(1, odd[t], 64);
        _tile_loadd(2, rows[t] + c, row_bytes);
        _tile_dpbf16ps(6, 0, 2);
        _tile_dpbf16ps(7, 1, 2);
        if (two) {
          _tile_loadd(3, rows[t] + c + 32, row_bytes);
          _tile_dpbf16ps(4, 0, 3);
          _tile_dpbf16ps(5, 1, 3);
        }
      }
      _tile_stored(6, totals + c, v * 4);
      _tile_stored(7, totals + c + 16, v * 4);
      if (two) {
        _tile_stored(4, totals + c + 32, v * 4);
        _tile_stored(5, totals + c + 48, v * 4);
      }
    }
  }
  softmax.finish(s.heads, max, sum);
  columns_from_halves(totals, s.heads, v, acc);
}
#else
void attend_amx(const MlaTile&, const uint16_t*, const uint16_t*, const int32_t*, int64_t,
                int64_t, float, float*, float*, float*) {}
#endif

}  // namespace pyengine::detail
