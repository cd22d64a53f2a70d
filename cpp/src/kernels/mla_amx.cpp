// MLA attention on AMX: 32 keys at a time, two 16-key tiles of the latent cache (A, rows
// a cache row apart) against the heads' queries packed as B pairs give the scores
// transposed (keys x heads); a vector per key holds every head's score, so the online
// softmax is 16 heads a lane; its weights, transposed to heads x keys in bfloat16, are A
// against the keys' values packed as B pairs (two keys' rows interleaved by unpacking,
// which leaves the columns in an order put right at the end), 16 value columns a tile
// product, added into the float accumulators in place (a tile loaded from them, kWindow
// steps' products added, stored back). A head's weights are taken against a reference
// that moves only when its scores pass it by kLazyMax (FlashAttention-4's lazy rescaling: the weights
// stay below e^8, exact in float32 sums), so that the accumulators are rarely rescaled.
// Keys outside [begin, end) get no weight, and their values are taken as zeros.
#include "mla_amx.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "amx_tiles.h"

namespace pyengine::detail {

bool mla_amx_fits(const MlaTile& s) {
  return amx_tiles_enabled() && s.heads <= 16 && s.latent % 32 == 0 && s.value % 32 == 0 &&
         s.block_size % 16 == 0;
}

#ifdef PYENGINE_AMX
namespace {

constexpr int kKeys = 32;  // a step's keys: two tiles of 16
constexpr float kLazyMax = 8.0f;
constexpr int kWindow = 4;  // steps whose weighted values go into the sums together

// Where the sums keep each of 32 value columns: unpacking two keys' rows (low, then high
// halves of each 128-bit lane) leaves columns 0-3, 8-11, 16-19, 24-27 in the first 16
// and the others in the second. Column a's place for a < 16; a + 16's is 8 on.
constexpr int32_t kStoredColumn[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};

// exp(x) lane-wise for x <= 88 (below -87 and -inf give 0): range reduction to r in
// [-ln2/2, ln2/2],
// a degree-6 polynomial, and the scaling by 2^n.
PYENGINE_AMX_TARGET inline __m512 exp_below_88(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(live, p, n);
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

// The rows of 16 keys from `first` (one cache block's), or null where none is a key.
inline const uint16_t* key_rows(const MlaTile& s, const uint16_t* cache, const int32_t* table,
                                int64_t first, int64_t end) {
  if (first >= end) return nullptr;
  const int64_t block = table[first / s.block_size];
  return cache + (block * s.block_size + first % s.block_size) * s.latent;
}

}  // namespace

PYENGINE_AMX_TARGET void attend_amx(const MlaTile& s, const uint16_t* q, const uint16_t* cache,
                                    const int32_t* table, int64_t begin, int64_t end, float scale,
                                    float* acc, float* max, float* sum) {
  const int64_t d = s.latent, v = s.value, row_bytes = d * 2;
  thread_local std::vector<uint16_t> qv, vv;
  thread_local std::vector<float> scores, sums16;
  // The heads' queries as B pairs: pair p of every head, [d / 2][16 heads][2].
  qv.assign(static_cast<size_t>(d * 16), 0);
  for (int64_t h = 0; h < s.heads; ++h) {
    for (int64_t p = 0; p < d / 2; ++p) {
      qv[static_cast<size_t>((p * 16 + h) * 2)] = q[h * d + 2 * p];
      qv[static_cast<size_t>((p * 16 + h) * 2 + 1)] = q[h * d + 2 * p + 1];
    }
  }
  vv.resize(static_cast<size_t>(kWindow * kKeys * v));
  scores.resize(static_cast<size_t>(kKeys * 16));
  // (local pointers: a thread_local's address is a call away in a shared library)
  const uint16_t* queries = qv.data();
  uint16_t* values = vv.data();
  float* step_scores = scores.data();
  alignas(64) uint16_t weights[kWindow][16 * kKeys];  // heads x keys, bfloat16, a step each
  __m512 running_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 running_sum = _mm512_setzero_ps();
  sums16.assign(static_cast<size_t>(16 * v), 0.0f);  // every tile row's (16 heads)
  float* totals = sums16.data();
  // Two keys' weights as one dword a head: [key 2p's 16 heads | key 2p+1's] interleaved.
  const __m512i pair_up = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                           1, 16, 0);
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
    // The step's max of each head (lanes), over its keys in range.
    __m512 step_max = running_max;
    __m512 lane_scores[kKeys];
    for (int k = 0; k < kKeys; ++k) {
      const int64_t key = first + k;
      lane_scores[k] = key >= begin && key < end
                           ? _mm512_mul_ps(_mm512_loadu_ps(step_scores + k * 16),
                                           _mm512_set1_ps(scale))
                           : _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      step_max = _mm512_max_ps(step_max, lane_scores[k]);
    }
    // The reference moves only where the step's max passes it by kLazyMax: then the
    // window's steps, weighted against the old one, go into the sums first, and the sums
    // of the heads whose reference moved are rescaled.
    const __mmask16 moves = _mm512_cmp_ps_mask(
        step_max, _mm512_add_ps(running_max, _mm512_set1_ps(kLazyMax)), _CMP_GT_OQ);
    const __m512 new_max = _mm512_mask_mov_ps(running_max, moves, step_max);
    const __m512 correction = exp_below_88(_mm512_sub_ps(running_max, new_max));
    running_max = new_max;
    running_sum = _mm512_mul_ps(running_sum, correction);
    if (moves != 0) {
      flush();
      alignas(64) float scale_of[16];
      _mm512_store_ps(scale_of, correction);
      for (int h = 0; h < 16; ++h) {
        if ((moves >> h & 1) == 0) continue;
        const __m512 factor = _mm512_set1_ps(scale_of[h]);
        for (int64_t c = 0; c < v; c += 16) {
          float* a = totals + h * v + c;
          _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(a), factor));
        }
      }
    }
    // The weights in bfloat16, transposed to heads x keys: two keys' a dword, 16 x 16
    // dwords turned over in registers.
    __m512i pairs[kKeys / 2];
    __m256i rounded[2];
    for (int k = 0; k < kKeys; ++k) {
      const __m512 e = exp_below_88(_mm512_sub_ps(lane_scores[k], new_max));
      rounded[k % 2] = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e));
      // (the sum of the weights as rounded: numerator and denominator agree)
      const __m512i widened = _mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded[k % 2]), 16);
      running_sum = _mm512_add_ps(running_sum, _mm512_castsi512_ps(widened));
      if (k % 2 == 1) {
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(rounded[0]), rounded[1], 1);
        pairs[k / 2] = _mm512_permutexvar_epi16(pair_up, both);
      }
    }
    transpose_dwords(pairs);
    uint16_t* step_weights = weights[pending];
    for (int h = 0; h < 16; ++h) _mm512_store_si512(step_weights + h * kKeys, pairs[h]);
    // The values as B pairs: two keys' rows interleaved, [16 pairs][v][2], each 32
    // columns as the unpacking leaves them (see kStoredColumn); zeros for keys out of
    // range.
    uint16_t* step_values = values + pending * kKeys * v;
    for (int p = 0; p < kKeys / 2; ++p) {
      const int64_t k0 = first + 2 * p, k1 = k0 + 1;
      const bool in0 = k0 >= begin && k0 < end, in1 = k1 >= begin && k1 < end;
      const uint16_t* r0 = in0 ? rows[p / 8] + (2 * p % 16) * d : nullptr;
      const uint16_t* r1 = in1 ? rows[p / 8] + (2 * p % 16 + 1) * d : nullptr;
      uint16_t* out = step_values + p * v * 2;
      for (int64_t c = 0; c < v; c += 32) {
        const __m512i a = r0 ? _mm512_loadu_si512(r0 + c) : _mm512_setzero_si512();
        const __m512i b = r1 ? _mm512_loadu_si512(r1 + c) : _mm512_setzero_si512();
        _mm512_storeu_si512(out + 2 * c, _mm512_unpacklo_epi16(a, b));
        _mm512_storeu_si512(out + 2 * c + 32, _mm512_unpackhi_epi16(a, b));
      }
    }
    if (++pending == kWindow) flush();
  }
  flush();
  alignas(64) float maxes[16], sums[16];
  _mm512_store_ps(maxes, running_max);
  _mm512_store_ps(sums, running_sum);
  std::copy_n(maxes, s.heads, max);
  std::copy_n(sums, s.heads, sum);
  // The sums' columns back in order, 32 at a time.
  const __m512i order = _mm512_loadu_si512(kStoredColumn);
  for (int64_t h = 0; h < s.heads; ++h) {
    for (int64_t c = 0; c < v; c += 32) {
      const float* stored = totals + h * v + c;
      float* out = acc + h * v + c;
      const __m512 first = _mm512_loadu_ps(stored), second = _mm512_loadu_ps(stored + 16);
      _mm512_storeu_ps(out, _mm512_permutex2var_ps(first, order, second));
      _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(
                                     first, _mm512_add_epi32(order, _mm512_set1_epi32(8)), second));
    }
  }
}
#else
void attend_amx(const MlaTile&, const uint16_t*, const uint16_t*, const int32_t*, int64_t,
                int64_t, float, float*, float*, float*) {}
#endif

}  // namespace pyengine::detail
