// A decode step's rows of x quantized to int8 per block and multiplied by block-quantized
// panels in integers (see quantized_panel.h): on AVX-512 VNNI, vpdpbusd takes a lane's 4
// unsigned weight bytes (nibbles, or int8 + 128) times 4 of x's bytes at once, where the
// float widening takes one weight per multiply-add; AVX2 sums the same products with
// vpmaddubsw and vpmaddwd, the portable build one at a time. All end in the same float32
// operations, so they agree bit for bit.
#include <cmath>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define PYENGINE_INT8_ROWS_X86 1
#endif

#include "float_convert.h"
#include "pyengine/int8_dense.h"
#include "quantized_panel.h"
#include "tensor_checks.h"
#include "vector_clones.h"

namespace pyengine::detail {
namespace {

constexpr int64_t kHalf = kQuantBlock / 2;  // the groups of the sums of x
constexpr int kLanes = 16;
constexpr int kVectors = static_cast<int>(kPanelWidth / kLanes);

// One block's xq and d; a block of zeros, or holding a NaN or an infinity, keeps xq 0 and
// d 0 (NaN, infinity: the sums then are NaN). (x / d is finite and within [-127, 127]
// then; the clamp is a guard, in comparisons that vectorize.)
inline void quantize_block(const float* x, int8_t* q, float& scale) {
  const float d = max_abs(x, kQuantBlock) / 127.0f;
  scale = d;
  if (!(d > 0.0f) || !std::isfinite(d)) {
    std::memset(q, 0, kQuantBlock);
    return;
  }
  for (int64_t i = 0; i < kQuantBlock; ++i) {
    const float rounded = std::nearbyint(x[i] / d);
    q[i] = static_cast<int8_t>(rounded > 127.0f ? 127.0f : rounded < -127.0f ? -127.0f : rounded);
  }
}

// A row's blocks, and the float and int sums of each half block of x and xq: each float
// sum in index order, as the portable multiply's reference has it, but a lane a half, so
// that the loops vectorize (the same bits in every clone).
PYENGINE_VECTOR_CLONES
void quantize_row(const float* x, int64_t k, int8_t* q, float* scale, float* sum,
                  int32_t* int_sum) {
  for (int64_t b = 0; b < k / kQuantBlock; ++b) {
    quantize_block(x + b * kQuantBlock, q + b * kQuantBlock, scale[b]);
  }
  const int64_t halves = k / kHalf;
  for (int64_t h = 0; h < halves; ++h) {
    sum[h] = 0.0f;
    int_sum[h] = 0;
  }
  for (int64_t i = 0; i < kHalf; ++i) {
    for (int64_t h = 0; h < halves; ++h) {
      sum[h] += x[h * kHalf + i];
      int_sum[h] += q[h * kHalf + i];
    }
  }
}

// What each build's float epilogue takes for row `row`'s group of weight rows from i0 in
// block b: x's scale d there, the sum of x over the group, and, for weights stored + 128,
// 128 times the sum of xq (to take off the integer sum).
struct GroupTerms {
  float d;
  float x_sum;
  int32_t bias;
};

inline GroupTerms group_terms(const Int8Rows& x, int64_t row, int64_t b, int64_t i0,
                              QuantCode code) {
  const int64_t h = row * (x.k / kHalf) + (b * kQuantBlock + i0) / kHalf;
  const bool two_halves = quantized_group_rows(code) != kHalf;
  const auto at = [&](const auto& halves) {
    return two_halves ? halves[h] + halves[h + 1] : halves[h];
  };
  return {x.scale[static_cast<size_t>(row * (x.k / kQuantBlock) + b)], at(x.sum),
          quantized_biased(code) ? 128 * at(x.int_sum) : 0};
}

// The int32 sum of q * xq over rows [i0, i0 + count) of a block's integers, column j.
int32_t column_dot(const uint8_t* ints, const int8_t* xq, int64_t i0, int64_t count, int64_t j,
                   QuantCode code) {
  int32_t dot = 0;
  for (int64_t i = i0; i < i0 + count; ++i) {
    dot += static_cast<int32_t>(quantized_value(ints, i, j, code)) * xq[i];
  }
  return dot;
}

void multiply_portable(const Int8Rows& x, int64_t r0, int rows, const uint8_t* panel,
                       QuantForm form, float* c) {
  const QuantCode code = form.code;
  const int64_t group_rows = quantized_group_rows(code), block_bytes = quantized_block_bytes(form);
  const bool offsets = quantized_offsets_stored(form.params);
  const int64_t blocks = x.k / kQuantBlock;
  for (int r = 0; r < rows; ++r) {
    const int8_t* xq = x.q.data() + (r0 + r) * x.k;
    for (int64_t j = 0; j < kPanelWidth; ++j) {
      float sum = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = panel + b * block_bytes;
        const uint8_t* ints = block + quantized_param_bytes(form);
        for (int64_t i0 = 0; i0 < kQuantBlock; i0 += group_rows) {
          // (quantized_value is q itself: no bias to take off)
          const int32_t dot = column_dot(ints, xq + b * kQuantBlock, i0, group_rows, j, code);
          const GroupTerms t = group_terms(x, r0 + r, b, i0, code);
          sum = std::fma(static_cast<float>(dot), quantized_scale(block, i0, j, form) * t.d, sum);
          if (offsets) sum = std::fma(quantized_offset(block, i0, j, form), t.x_sum, sum);
        }
      }
      c[r * kPanelWidth + j] = sum;
    }
  }
}

#ifdef PYENGINE_INT8_ROWS_X86
#define PYENGINE_INT8_ROWS_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// The 4 bytes of xq at p in every lane.
PYENGINE_INT8_ROWS_VNNI inline __m512i broadcast4(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm512_set1_epi32(word);
}

template <int kRows, QuantCode kCode>
PYENGINE_INT8_ROWS_VNNI void multiply_vnni(const Int8Rows& x, int64_t r0, const uint8_t* panel,
                                           QuantParams params, float* c) {
  constexpr int64_t kGroupRows = quantized_group_rows(kCode);
  constexpr int64_t kLaneRows = quantized_lane_rows(kCode);
  const QuantForm form{kCode, params};
  const int64_t block_bytes = quantized_block_bytes(form);
  const bool offsets = quantized_offsets_stored(params);
  const int64_t blocks = x.k / kQuantBlock;
  const __m512i low_nibbles = _mm512_set1_epi8(15);
  const int8_t* xq[kRows];
  for (int r = 0; r < kRows; ++r) xq[r] = x.q.data() + (r0 + r) * x.k;
  __m512 sum[kRows][kVectors];
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVectors; ++v) sum[r][v] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * block_bytes;
    // (read once, in order: asked for a few blocks ahead, as the widening does)
    for (int64_t line = 0; line < block_bytes; line += 64) {
      __builtin_prefetch(block + 4 * block_bytes + line, 0, 1);
    }
    const uint8_t* ints = block + quantized_param_bytes(form);
    for (int64_t i0 = 0; i0 < kQuantBlock; i0 += kGroupRows) {
      __m512i dot[kRows][kVectors];
      for (int r = 0; r < kRows; ++r) {
        for (int v = 0; v < kVectors; ++v) dot[r][v] = _mm512_setzero_si512();
      }
      for (int64_t i = i0; i < i0 + kGroupRows; i += kLaneRows) {
        for (int v = 0; v < kVectors; ++v) {
          const __m512i w = _mm512_loadu_si512(ints + (i / kLaneRows * kPanelWidth + v * kLanes) * 4);
          if constexpr (kCode == QuantCode::kNibble) {
            const __m512i low = _mm512_and_si512(w, low_nibbles);
            const __m512i high = _mm512_and_si512(_mm512_srli_epi32(w, 4), low_nibbles);
            for (int r = 0; r < kRows; ++r) {
              const int8_t* q = xq[r] + b * kQuantBlock + i;
              dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], low, broadcast4(q));
              dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], high, broadcast4(q + 4));
            }
          } else {
            for (int r = 0; r < kRows; ++r) {
              dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], w, broadcast4(xq[r] + b * kQuantBlock + i));
            }
          }
        }
      }
      __m512 scales[kVectors], offset[kVectors];
      for (int v = 0; v < kVectors; ++v) load_quantized_params(block, i0, v, form, scales[v], offset[v]);
      for (int r = 0; r < kRows; ++r) {
        const GroupTerms t = group_terms(x, r0 + r, b, i0, kCode);
        const __m512 scale_d = _mm512_set1_ps(t.d), x_sums = _mm512_set1_ps(t.x_sum);
        for (int v = 0; v < kVectors; ++v) {
          const __m512i exact = _mm512_sub_epi32(dot[r][v], _mm512_set1_epi32(t.bias));
          const __m512 scale = _mm512_mul_ps(scales[v], scale_d);
          sum[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, sum[r][v]);
          if (offsets) sum[r][v] = _mm512_fmadd_ps(offset[v], x_sums, sum[r][v]);
        }
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(c + r * kPanelWidth + v * kLanes, sum[r][v]);
  }
}
#pragma GCC diagnostic pop

#define PYENGINE_INT8_ROWS_AVX2 __attribute__((target("avx2,fma,f16c")))
constexpr int kLanes8 = 8;  // an AVX2 vector's columns

// Each lane's int32 sum of its 4 products: AVX2 has no vpdpbusd, and vpmaddubsw's int16
// pairs of unsigned times signed bytes are exact only for small unsigned ones (nibbles:
// at most 2 * 15 * 127); a byte goes as its two nibbles, the high one's sum times 16.
PYENGINE_INT8_ROWS_AVX2 inline __m256i dot4_nibbles(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}
PYENGINE_INT8_ROWS_AVX2 inline __m256i dot4_bytes(__m256i w, __m256i x) {
  const __m256i nibble = _mm256_set1_epi8(15);
  const __m256i low = _mm256_and_si256(w, nibble);
  const __m256i high = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
  return _mm256_add_epi32(_mm256_slli_epi32(dot4_nibbles(high, x), 4), dot4_nibbles(low, x));
}

PYENGINE_INT8_ROWS_AVX2 inline __m256i broadcast4_avx2(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm256_set1_epi32(word);
}

// multiply_vnni's sums and float operations, 8 columns at a time (a pass over the panel
// each: the panel stays in L1 between them, and 16 registers hold a pass's sums).
template <int kRows, QuantCode kCode>
PYENGINE_INT8_ROWS_AVX2 void multiply_avx2(const Int8Rows& x, int64_t r0, const uint8_t* panel,
                                           QuantParams params, float* c) {
  constexpr int64_t kGroupRows = quantized_group_rows(kCode);
  constexpr int64_t kLaneRows = quantized_lane_rows(kCode);
  const QuantForm form{kCode, params};
  const int64_t block_bytes = quantized_block_bytes(form);
  const bool offsets = quantized_offsets_stored(params);
  const int64_t blocks = x.k / kQuantBlock;
  const __m256i low_nibbles = _mm256_set1_epi8(15);
  for (int v = 0; v < static_cast<int>(kPanelWidth / kLanes8); ++v) {
    __m256 sum[kRows];
    for (int r = 0; r < kRows; ++r) sum[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = panel + b * block_bytes;
      const uint8_t* ints = block + quantized_param_bytes(form);
      for (int64_t i0 = 0; i0 < kQuantBlock; i0 += kGroupRows) {
        __m256i dot[kRows];
        for (int r = 0; r < kRows; ++r) dot[r] = _mm256_setzero_si256();
        for (int64_t i = i0; i < i0 + kGroupRows; i += kLaneRows) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
              ints + (i / kLaneRows * kPanelWidth + v * kLanes8) * 4));
          for (int r = 0; r < kRows; ++r) {
            const int8_t* q = x.q.data() + (r0 + r) * x.k + b * kQuantBlock + i;
            if constexpr (kCode == QuantCode::kNibble) {
              const __m256i low = _mm256_and_si256(w, low_nibbles);
              const __m256i high = _mm256_and_si256(_mm256_srli_epi32(w, 4), low_nibbles);
              dot[r] = _mm256_add_epi32(dot[r], dot4_nibbles(low, broadcast4_avx2(q)));
              dot[r] = _mm256_add_epi32(dot[r], dot4_nibbles(high, broadcast4_avx2(q + 4)));
            } else {
              dot[r] = _mm256_add_epi32(dot[r], dot4_bytes(w, broadcast4_avx2(q)));
            }
          }
        }
        __m256 scales, offset;
        load_quantized_params8(block, i0, v, form, scales, offset);
        for (int r = 0; r < kRows; ++r) {
          const GroupTerms t = group_terms(x, r0 + r, b, i0, kCode);
          const __m256i exact = _mm256_sub_epi32(dot[r], _mm256_set1_epi32(t.bias));
          const __m256 scale = _mm256_mul_ps(scales, _mm256_set1_ps(t.d));
          sum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), scale, sum[r]);
          if (offsets) sum[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(t.x_sum), sum[r]);
        }
      }
    }
    for (int r = 0; r < kRows; ++r) _mm256_storeu_ps(c + r * kPanelWidth + v * kLanes8, sum[r]);
  }
}

template <QuantCode kCode>
void multiply_avx2(const Int8Rows& x, int64_t r0, int rows, const uint8_t* panel,
                  QuantParams params, float* c) {
  with_register_rows(rows, [&](auto n) {
    multiply_avx2<decltype(n)::value, kCode>(x, r0, panel, params, c);
  });
}

template <QuantCode kCode>
void multiply_vnni(const Int8Rows& x, int64_t r0, int rows, const uint8_t* panel,
                  QuantParams params, float* c) {
  with_register_rows(rows, [&](auto n) {
    multiply_vnni<decltype(n)::value, kCode>(x, r0, panel, params, c);
  });
}
#endif

}  // namespace

void Int8Rows::quantize(const float* a, int64_t lda, int64_t rows, int64_t k_) {
  k = k_;
  const int64_t blocks = k / kQuantBlock, halves = k / kHalf;
  q.resize(static_cast<size_t>(rows * k));
  scale.resize(static_cast<size_t>(rows * blocks));
  sum.resize(static_cast<size_t>(rows * halves));
  int_sum.resize(static_cast<size_t>(rows * halves));
#pragma omp parallel for if (rows * k >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    quantize_row(a + r * lda, k, q.data() + r * k, scale.data() + r * blocks,
                 sum.data() + r * halves, int_sum.data() + r * halves);
  }
}

void multiply_int8_rows(const Int8Rows& x, int64_t r0, int rows, const uint8_t* panel,
                        QuantForm form, float* c) {
#ifdef PYENGINE_INT8_ROWS_X86
  if (int8_dense_vnni()) {
    const QuantParams params = form.params;
    switch (form.code) {
      case QuantCode::kNibble:
        return multiply_vnni<QuantCode::kNibble>(x, r0, rows, panel, params, c);
      case QuantCode::kInt8Halves:
        return multiply_vnni<QuantCode::kInt8Halves>(x, r0, rows, panel, params, c);
      default: return multiply_vnni<QuantCode::kInt8>(x, r0, rows, panel, params, c);
    }
  }
  if (quantized_dense_isa() != CpuIsa::kGeneric) {  // AVX2 (pinned, or AVX-512 without VNNI)
    const QuantParams params = form.params;
    switch (form.code) {
      case QuantCode::kNibble:
        return multiply_avx2<QuantCode::kNibble>(x, r0, rows, panel, params, c);
      case QuantCode::kInt8Halves:
        return multiply_avx2<QuantCode::kInt8Halves>(x, r0, rows, panel, params, c);
      default: return multiply_avx2<QuantCode::kInt8>(x, r0, rows, panel, params, c);
    }
  }
#endif
  multiply_portable(x, r0, rows, panel, form, c);
}

}  // namespace pyengine::detail
