// MLA attention's inner loops for bfloat16 queries over a bfloat16 latent cache, a
// token's every head against its keys with a head a lane (AVX-512 vectors of 16 heads):
// on AMX's tiles (mla_amx.cpp) and on AVX512-BF16's dot products for CPUs without AMX
// (mla_bf16.cpp, AMD Zen 4 and 5, Intel Cooper Lake), and the steps they share. Both
// keep an online softmax per head whose reference moves only when the scores pass it by kLazyMax (FlashAttention-4's
// lazy rescaling: the weights stay below e^8, exact in float32 sums), so that the float
// sums of the weighted values are rarely rescaled. Internal to pyengine_core.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PYENGINE_MLA_LANES 1
#include <immintrin.h>
#define PYENGINE_MLA_LANES_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#endif

namespace pyengine::detail {

struct MlaTile {
  int64_t heads, latent, value, block_size;
};

// The shapes the lane kernels take in a call: at most 16 heads (mla_attention gives them
// 16 at a time), the latent a multiple of 32, the value of 32, blocks of 16 keys or a
// multiple.
inline bool mla_lanes_fit(const MlaTile& s) {
  return s.heads <= 16 && s.latent % 32 == 0 && s.value % 32 == 0 && s.block_size % 16 == 0;
}

// Whether attend_amx runs these shapes: AMX usable (amx_tiles_enabled) and the shapes
// the lane kernels take.
bool mla_amx_fits(const MlaTile& s);

// Whether attend_bf16 runs these shapes here: the CPU has AVX512-BF16, the attention
// kernels run their AVX-512 build (attention_isa), and the shapes the lane kernels take.
bool mla_bf16_fits(const MlaTile& s);

// Every head's softmax over keys [begin, end) of a request (`table` its block table),
// unnormalised, into acc [heads, value], max and sum [heads]; q [heads, latent] bfloat16
// (as uint16). attend_amx on AMX's tiles (the caller holds the thread's tiles
// configured: AmxTiles), attend_bf16 on AVX512-BF16's dot products.
void attend_amx(const MlaTile& s, const uint16_t* q, const uint16_t* cache, const int32_t* table,
                int64_t begin, int64_t end, float scale, float* acc, float* max, float* sum);
void attend_bf16(const MlaTile& s, const uint16_t* q, const uint16_t* cache, const int32_t* table,
                 int64_t begin, int64_t end, float scale, float* acc, float* max, float* sum);

// The rows of 16 keys from `first` (one cache block's), or null where none is a key.
inline const uint16_t* key_rows(const MlaTile& s, const uint16_t* cache, const int32_t* table,
                                int64_t first, int64_t end) {
  if (first >= end) return nullptr;
  const int64_t block = table[first / s.block_size];
  return cache + (block * s.block_size + first % s.block_size) * s.latent;
}

// The heads' queries q [heads, latent] as pairs: pair p of every head, [latent / 2][16
// heads][2], zeros for the heads past `heads` (a dword a head, as AMX's B operand and as
// AVX512-BF16's dot products take them).
inline void pack_queries(const uint16_t* q, int64_t heads, int64_t d, std::vector<uint16_t>& out) {
  out.assign(static_cast<size_t>(d * 16), 0);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t p = 0; p < d / 2; ++p) {
      out[static_cast<size_t>((p * 16 + h) * 2)] = q[h * d + 2 * p];
      out[static_cast<size_t>((p * 16 + h) * 2 + 1)] = q[h * d + 2 * p + 1];
    }
  }
}

#ifdef PYENGINE_MLA_LANES

inline constexpr int kLaneKeys = 32;  // a step's keys
inline constexpr float kLazyMax = 8.0f;

// exp(x) lane-wise for x <= 88 (below -87 and -inf give 0): range reduction to r in
// [-ln2/2, ln2/2], a degree-6 polynomial, and the scaling by 2^n.
PYENGINE_MLA_LANES_TARGET inline __m512 exp_below_88(__m512 x) {
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

// One head's online softmax a lane.
class LaneSoftmax {
 public:
  PYENGINE_MLA_LANES_TARGET LaneSoftmax()
      : max_(_mm512_set1_ps(-std::numeric_limits<float>::infinity())),
        sum_(_mm512_setzero_ps()) {}

  // The scores of n keys from key `first` (raw: query . key, a vector of heads per key)
  // scaled, -inf for keys outside [begin, end); then the reference moved where their max
  // passes it by kLazyMax. Returns the heads whose reference moved, their sums' factor
  // in `correction`.
  PYENGINE_MLA_LANES_TARGET __mmask16 step(__m512* scores, int n, int64_t first, int64_t begin,
                                           int64_t end, float scale, __m512& correction) {
    __m512 step_max = max_;
    for (int k = 0; k < n; ++k) {
      const int64_t key = first + k;
      scores[k] = key >= begin && key < end
                      ? _mm512_mul_ps(scores[k], _mm512_set1_ps(scale))
                      : _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      step_max = _mm512_max_ps(step_max, scores[k]);
    }
    const __mmask16 moves =
        _mm512_cmp_ps_mask(step_max, _mm512_add_ps(max_, _mm512_set1_ps(kLazyMax)), _CMP_GT_OQ);
    const __m512 moved = _mm512_mask_mov_ps(max_, moves, step_max);
    correction = exp_below_88(_mm512_sub_ps(max_, moved));
    max_ = moved;
    sum_ = _mm512_mul_ps(sum_, correction);
    return moves;
  }

  // The n keys' weights in bfloat16 (a vector of heads a key). Their sum, as rounded,
  // goes into the denominator, so that it and the numerator agree.
  PYENGINE_MLA_LANES_TARGET void weights(const __m512* scores, int n, __m256i* rounded) {
    for (int k = 0; k < n; ++k) {
      const __m512 e = exp_below_88(_mm512_sub_ps(scores[k], max_));
      rounded[k] = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e));
      const __m512i widened = _mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded[k]), 16);
      sum_ = _mm512_add_ps(sum_, _mm512_castsi512_ps(widened));
    }
  }

  PYENGINE_MLA_LANES_TARGET void finish(int64_t heads, float* max, float* sum) const {
    alignas(64) float maxes[16], sums[16];
    _mm512_store_ps(maxes, max_);
    _mm512_store_ps(sums, sum_);
    std::copy_n(maxes, heads, max);
    std::copy_n(sums, heads, sum);
  }

 private:
  __m512 max_, sum_;
};

// Two keys' weights a dword a head: pairs[p] lane h holds head h's weights (rounded[k]:
// key k's heads) of keys 2p and 2p + 1, for n keys.
PYENGINE_MLA_LANES_TARGET inline void pair_keys(const __m256i* rounded, int n, __m512i* pairs) {
  // [key 2p's 16 heads | key 2p+1's] interleaved
  const __m512i pair_up = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                           1, 16, 0);
  for (int p = 0; p < n / 2; ++p) {
    const __m512i both =
        _mm512_inserti64x4(_mm512_castsi256_si512(rounded[2 * p]), rounded[2 * p + 1], 1);
    pairs[p] = _mm512_permutexvar_epi16(pair_up, both);
  }
}

// The sums [16 heads][v] of the heads in `moves` times their lane of `correction`.
PYENGINE_MLA_LANES_TARGET inline void rescale_heads(float* totals, int64_t v, __mmask16 moves,
                                                    __m512 correction) {
  alignas(64) float factor_of[16];
  _mm512_store_ps(factor_of, correction);
  for (int h = 0; h < 16; ++h) {
    if ((moves >> h & 1) == 0) continue;
    const __m512 factor = _mm512_set1_ps(factor_of[h]);
    for (int64_t c = 0; c < v; c += 16) {
      float* a = totals + h * v + c;
      _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(a), factor));
    }
  }
}

#endif  // PYENGINE_MLA_LANES

}  // namespace pyengine::detail
