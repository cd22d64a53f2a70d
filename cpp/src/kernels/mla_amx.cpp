// MLA attention on AMX: 32 keys at a time, two 16-key tiles of the latent cache (A, rows
// a cache row apart) against the heads' queries packed as B pairs give the scores
// transposed (keys x heads); a vector per key holds every head's score, so the online
// softmax is 16 heads a lane (mla_lanes.h); its weights, transposed to heads x keys in
// bfloat16, are A against the keys' values paired as B, 16 value columns a tile product,
// added into the float accumulators in place (a tile loaded from them, kWindow steps'
// products added, stored back). Keys outside [begin, end) get no weight, and their
// values are taken as zeros.
#include "mla_amx.h"

#include <vector>

#include "amx_tiles.h"

namespace pyengine::detail {

bool mla_amx_fits(const MlaTile& s) { return amx_tiles_enabled() && mla_lanes_fit(s); }

#ifdef PYENGINE_AMX
namespace {

constexpr int kKeys = kLaneKeys;
constexpr int kWindow = 4;  // steps whose weighted values go into the sums together

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
  thread_local std::vector<uint16_t> qv, vv;
  thread_local std::vector<float> scores, sums16;
  pack_queries(q, s.heads, d, qv);  // (B pairs)
  vv.resize(static_cast<size_t>(kWindow * kKeys * v));
  scores.resize(static_cast<size_t>(kKeys * 16));
  // (local pointers: a thread_local's address is a call away in a shared library)
  const uint16_t* queries = qv.data();
  uint16_t* values = vv.data();
  float* step_scores = scores.data();
  alignas(64) uint16_t weights[kWindow][16 * kKeys];  // heads x keys, bfloat16, a step each
  LaneSoftmax softmax;
  sums16.assign(static_cast<size_t>(16 * v), 0.0f);  // every tile row's (16 heads)
  float* totals = sums16.data();
  int pending = 0;  // steps whose weights and values wait in the window
  // The window's weighted values added to the sums, 16 columns a tile (its weights in
  // tiles 0, 1, 3 and 4; the scores' tiles are free here).
  const auto flush = [&] {
    if (pending > 0) _tile_loadd(0, weights[0], kKeys * 2);
    if (pending > 1) _tile_loadd(1, weights[1], kKeys * 2);
    if (pending > 2) _tile_loadd(3, weights[2], kKeys * 2);
    if (pending > 3) _tile_loadd(4, weights[3], kKeys * 2);
    const int64_t step_values = kKeys * v;
    for (int64_t c = 0; c < v && pending > 0; c += 16) {
      _tile_loadd(7, totals + c, v * 4);
      _tile_loadd(6, values + c * 2, v * 4);
      _tile_dpbf16ps(7, 0, 6);
      if (pending > 1) {
        _tile_loadd(5, values + step_values + c * 2, v * 4);
        _tile_dpbf16ps(7, 1, 5);
      }
      if (pending > 2) {
        _tile_loadd(6, values + 2 * step_values + c * 2, v * 4);
        _tile_dpbf16ps(7, 3, 6);
      }
      if (pending > 3) {
        _tile_loadd(5, values + 3 * step_values + c * 2, v * 4);
        _tile_dpbf16ps(7, 4, 5);
      }
      _tile_stored(7, totals + c, v * 4);
    }
    pending = 0;
  };
  for (int64_t first = begin - begin % 16; first < end; first += kKeys) {
    const uint16_t* rows[2] = {key_rows(s, cache, table, first, end),
                               key_rows(s, cache, table, first + 16, end)};
    // The next step's rows (two runs of 16 rows, each contiguous in its block) asked for
    // into L2, 16 lines of each run a column tile, so that their misses overlap this
    // step's arithmetic: one core alone waits on L3 and memory otherwise (its misses in
    // flight are too few), and the blocks lie anywhere in the pool.
    const char* ahead[2] = {
        reinterpret_cast<const char*>(key_rows(s, cache, table, first + kKeys, end)),
        reinterpret_cast<const char*>(key_rows(s, cache, table, first + kKeys + 16, end))};
    // Scores, transposed: tiles 0 and 1 [16 keys][16 heads].
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < d; c += 32) {
      for (const char* next : ahead) {
        if (next == nullptr) continue;
        const char* slice = next + c * 32;  // (16 rows of 64 bytes a column tile)
        for (int line = 0; line < 16; ++line) {
          _mm_prefetch(slice + line * 64, _MM_HINT_T1);
        }
      }
      _tile_loadd(2, queries + c * 16, 64);
      if (rows[0] != nullptr) {
        _tile_loadd(3, rows[0] + c, row_bytes);
        _tile_dpbf16ps(0, 3, 2);
      }
      if (rows[1] != nullptr) {
        _tile_loadd(4, rows[1] + c, row_bytes);
        _tile_dpbf16ps(1, 4, 2);
      }
    }
    _tile_stored(0, step_scores, 64);
    _tile_stored(1, step_scores + 256, 64);
    __m512 lane_scores[kKeys];
    for (int k = 0; k < kKeys; ++k) lane_scores[k] = _mm512_loadu_ps(step_scores + k * 16);
    __m512 correction;
    const __mmask16 moves = softmax.step(lane_scores, first, begin, end, scale, correction);
    if (moves != 0) {
      // the window's steps, weighted against the old references, into the sums first
      flush();
      rescale_heads(totals, v, moves, correction);
    }
    // The weights transposed to heads x keys: 16 x 16 dwords turned over in registers.
    __m512i pairs[kKeys / 2];
    softmax.weights(lane_scores, pairs);
    transpose_dwords(pairs);
    uint16_t* step_weights = weights[pending];
    for (int h = 0; h < 16; ++h) _mm512_store_si512(step_weights + h * kKeys, pairs[h]);
    pair_values(rows, first, begin, end, d, v, values + pending * kKeys * v);
    if (++pending == kWindow) flush();
  }
  flush();
  softmax.finish(s.heads, max, sum);
  columns_in_order(totals, s.heads, v, acc);
}
#else
void attend_amx(const MlaTile&, const uint16_t*, const uint16_t*, const int32_t*, int64_t,
                int64_t, float, float*, float*, float*) {}
#endif

}  // namespace pyengine::detail
