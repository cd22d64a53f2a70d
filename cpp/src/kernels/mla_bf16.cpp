// MLA attention on AVX512-BF16: a head a lane, as on AMX (mla_lanes.h). A key's scores
// are one vector of its 16 heads' dot products, built a latent pair at a time: the
// heads' query pairs (one vector) against the key's pair broadcast, 16 keys' sums at
// once. The values go in as pairs of keys' rows interleaved (16 columns' pairs a vector)
// against each head's pair of weights broadcast, into float sums held in registers for
// 4 heads x 64 columns across the step's 32 keys.
#include "mla_lanes.h"

#include <cstring>
#include <vector>

#include "pyengine/attention.h"

namespace pyengine::detail {

#ifdef PYENGINE_MLA_LANES
namespace {

constexpr int kKeys = kLaneKeys;
constexpr int kHeadsAtOnce = 4;

// Where the sums keep each of 32 value columns: unpacking two keys' rows (low, then high
// halves of each 128-bit lane) leaves columns 0-3, 8-11, 16-19, 24-27 in the first 16
// and the others in the second. Column a's place for a < 16; a + 16's is 8 on.
constexpr int32_t kStoredColumn[16] = {0,  1,  2,  3,  16, 17, 18, 19,
                                              4,  5,  6,  7,  20, 21, 22, 23};

// The step's values (the first v numbers of each key's row; rows[i] the 16 rows from key
// first + 16 i) as pairs: two keys' rows interleaved, [16 pairs][v][2], each 32 columns
// as kStoredColumn places them; zeros for keys outside [begin, end).
PYENGINE_MLA_LANES_TARGET void pair_values(const uint16_t* const rows[2], int64_t first,
                                                  int64_t begin, int64_t end, int64_t d,
                                                  int64_t v, uint16_t* out) {
  for (int p = 0; p < kLaneKeys / 2; ++p) {
    const int64_t k0 = first + 2 * p, k1 = k0 + 1;
    const bool in0 = k0 >= begin && k0 < end, in1 = k1 >= begin && k1 < end;
    const uint16_t* r0 = in0 ? rows[p / 8] + (2 * p % 16) * d : nullptr;
    const uint16_t* r1 = in1 ? rows[p / 8] + (2 * p % 16 + 1) * d : nullptr;
    uint16_t* pair = out + p * v * 2;
    for (int64_t c = 0; c < v; c += 32) {
      const __m512i a = r0 ? _mm512_loadu_si512(r0 + c) : _mm512_setzero_si512();
      const __m512i b = r1 ? _mm512_loadu_si512(r1 + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(pair + 2 * c, _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(pair + 2 * c + 32, _mm512_unpackhi_epi16(a, b));
    }
  }
}

// The sums [heads][v] (columns as kStoredColumn places them) into acc in order.
PYENGINE_MLA_LANES_TARGET void columns_in_order(const float* totals, int64_t heads,
                                                       int64_t v, float* acc) {
  const __m512i order = _mm512_loadu_si512(kStoredColumn);
  const __m512i order_high = _mm512_add_epi32(order, _mm512_set1_epi32(8));
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t c = 0; c < v; c += 32) {
      const float* stored = totals + h * v + c;
      float* out = acc + h * v + c;
      const __m512 low = _mm512_loadu_ps(stored), high = _mm512_loadu_ps(stored + 16);
      _mm512_storeu_ps(out, _mm512_permutex2var_ps(low, order, high));
      _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(low, order_high, high));
    }
  }
}

bool cpu_has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
}

// A dword of `row` (two bfloat16s), broadcast.
PYENGINE_MLA_LANES_TARGET inline __m512bh broadcast_pair(const uint16_t* row) {
  int32_t pair;
  std::memcpy(&pair, row, sizeof pair);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
}

// The scores of 16 keys (rows a latent row apart): scores[k] lane h = query h . key k.
PYENGINE_MLA_LANES_TARGET inline void key_scores(const uint16_t* queries, const uint16_t* rows,
                                                 int64_t d, __m512 scores[16]) {
  for (int k = 0; k < 16; ++k) scores[k] = _mm512_setzero_ps();
  for (int64_t p = 0; p < d / 2; ++p) {
    const auto pairs = reinterpret_cast<__m512bh>(_mm512_loadu_si512(queries + p * 32));
    for (int k = 0; k < 16; ++k) {
      scores[k] = _mm512_dpbf16_ps(scores[k], pairs, broadcast_pair(rows + k * d + 2 * p));
    }
  }
}

// sums [16 heads][v] (columns as stored) of heads [h0, h0 + 4) and columns [c, c + 16
// kVectors) plus the step's weights (weights[p][h]: head h's of keys 2p, 2p + 1) times
// its paired values.
template <int kVectors>
PYENGINE_MLA_LANES_TARGET inline void add_values(float* sums, int64_t v, int64_t h0, int64_t c,
                                                 const int32_t (*weights)[16],
                                                 const uint16_t* values) {
  __m512 a[kHeadsAtOnce][kVectors];
  for (int i = 0; i < kHeadsAtOnce; ++i) {
    for (int j = 0; j < kVectors; ++j) a[i][j] = _mm512_loadu_ps(sums + (h0 + i) * v + c + 16 * j);
  }
  for (int p = 0; p < kKeys / 2; ++p) {
    const uint16_t* pair = values + p * v * 2 + c * 2;
    __m512bh x[kVectors];
    for (int j = 0; j < kVectors; ++j) {
      x[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(pair + 32 * j));
    }
    for (int i = 0; i < kHeadsAtOnce; ++i) {
      const auto w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(weights[p][h0 + i]));
      for (int j = 0; j < kVectors; ++j) a[i][j] = _mm512_dpbf16_ps(a[i][j], w, x[j]);
    }
  }
  for (int i = 0; i < kHeadsAtOnce; ++i) {
    for (int j = 0; j < kVectors; ++j) _mm512_storeu_ps(sums + (h0 + i) * v + c + 16 * j, a[i][j]);
  }
}

}  // namespace

bool mla_bf16_fits(const MlaTile& s) {
  return mla_lanes_fit(s) && attention_isa() == CpuIsa::kAvx512 && cpu_has_bf16_dot();
}

PYENGINE_MLA_LANES_TARGET void attend_bf16(const MlaTile& s, const uint16_t* q,
                                           const uint16_t* cache, const int32_t* table,
                                           int64_t begin, int64_t end, float scale, float* acc,
                                           float* max, float* sum) {
  const int64_t d = s.latent, v = s.value;
  thread_local std::vector<uint16_t> qv, vv;
  thread_local std::vector<float> sums16;
  pack_queries(q, s.heads, d, qv);
  vv.resize(static_cast<size_t>(kKeys * v));
  sums16.assign(static_cast<size_t>(16 * v), 0.0f);
  // (local pointers: a thread_local's address is a call away in a shared library)
  const uint16_t* queries = qv.data();
  uint16_t* values = vv.data();
  float* totals = sums16.data();
  LaneSoftmax softmax;
  for (int64_t first = begin - begin % 16; first < end; first += kKeys) {
    const uint16_t* rows[2] = {key_rows(s, cache, table, first, end),
                               key_rows(s, cache, table, first + 16, end)};
    __m512 scores[kKeys];
    for (int half = 0; half < 2; ++half) {
      if (rows[half] != nullptr) {
        key_scores(queries, rows[half], d, scores + 16 * half);
      } else {
        for (int k = 0; k < 16; ++k) scores[16 * half + k] = _mm512_setzero_ps();  // (masked)
      }
    }
    __m512 correction;
    const __mmask16 moves = softmax.step(scores, kKeys, first, begin, end, scale, correction);
    if (moves != 0) rescale_heads(totals, v, moves, correction);
    __m256i rounded[kKeys];
    softmax.weights(scores, kKeys, rounded);
    __m512i pairs[kKeys / 2];
    pair_keys(rounded, kKeys, pairs);
    alignas(64) int32_t weights[kKeys / 2][16];
    for (int p = 0; p < kKeys / 2; ++p) _mm512_store_si512(weights[p], pairs[p]);
    pair_values(rows, first, begin, end, d, v, values);
    for (int64_t h0 = 0; h0 < s.heads; h0 += kHeadsAtOnce) {
      int64_t c = 0;
      for (; c + 64 <= v; c += 64) add_values<4>(totals, v, h0, c, weights, values);
      if (c < v) add_values<2>(totals, v, h0, c, weights, values);  // (v: a multiple of 32)
    }
  }
  softmax.finish(s.heads, max, sum);
  columns_in_order(totals, s.heads, v, acc);
}
#else
bool mla_bf16_fits(const MlaTile&) { return false; }
void attend_bf16(const MlaTile&, const uint16_t*, const uint16_t*, const int32_t*, int64_t,
                 int64_t, float, float*, float*, float*) {}
#endif

}  // namespace pyengine::detail
