// Block-quantized panels (layout in quantized_panel.h): packing from [k, n] integers,
// scales and offsets, and widening to float32.
#include "quantized_panel.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "attention_checks.h"

namespace pyengine {
namespace {

using detail::kQuantParamBytes;
using detail::quantized_block_bytes;

constexpr int kLanes = 16;
constexpr int64_t kPrefetchBlocks = 4;

void check_quantized_args(const char* op, const TensorView& packed, const TensorView& q_t,
                          const TensorView& scale_t, const TensorView& offset_t, bool gate_up) {
  detail::check_cpu(packed, op, "packed");
  const int bits = detail::quantized_bits(packed.dtype);
  if (bits == 0) {
    throw InvalidArgument(detail::arg(op, "packed") +
                          " must be uint8 (4-bit weights) or int8 (8-bit), got " +
                          packed.describe());
  }
  detail::check_rows(q_t, op, "q_t", 2, packed.dtype);
  const int64_t k = q_t.shape[0], n = q_t.shape[1];
  if (k % kQuantBlock != 0) {
    throw InvalidArgument(std::string(op) + ": k (q_t's rows) must be a multiple of " +
                          std::to_string(kQuantBlock) + ", got " + q_t.describe());
  }
  if (gate_up && n % 2 != 0) {
    throw InvalidArgument(std::string(op) + ": q_t must be [k, 2n] (gate columns, then up), got " +
                          q_t.describe());
  }
  for (const auto& [t, name] : {std::pair{&scale_t, "scale_t"}, std::pair{&offset_t, "offset_t"}}) {
    detail::check_rows(*t, op, name, 2, DType::kFloat32);
    if (t->shape[0] != k / kQuantBlock || t->shape[1] != n) {
      throw InvalidArgument(detail::arg(op, name) + " must be [" + std::to_string(k / kQuantBlock) +
                            ", " + std::to_string(n) + "] (a block of " +
                            std::to_string(kQuantBlock) + " rows of q_t each), got " +
                            t->describe());
    }
  }
  // With at most 16 significant bits a scale times an int8 is exact in float32, so any
  // rounding of q * scale + offset (a multiply-add, or the product, then the sum) is one.
  for (int64_t b = 0; b < k / kQuantBlock; ++b) {
    const auto* row = static_cast<const float*>(scale_t.data) + b * scale_t.strides[0];
    if (std::any_of(row, row + n,
                    [](float s) { return (std::bit_cast<uint32_t>(s) & 0xff) != 0; })) {
      throw InvalidArgument(std::string(op) + ": scale_t must have at most 16 significant bits " +
                            "(a float16's 11 fit), so that q * scale is exact; block row " +
                            std::to_string(b) + " has more");
    }
  }
  const int64_t size = gate_up ? 2 * packed_quantized_weight_size(k, n / 2, bits)
                               : packed_quantized_weight_size(k, n, bits);
  if (packed.ndim != 1 || packed.shape[0] != size || packed.strides[0] != 1) {
    throw InvalidArgument(detail::arg(op, "packed") + " must be dense [" + std::to_string(size) +
                          "], got " + packed.describe());
  }
  if (bits == 4) {
    for (int64_t i = 0; i < k; ++i) {
      const auto* row = static_cast<const uint8_t*>(q_t.data) + i * q_t.strides[0];
      if (std::any_of(row, row + n, [](uint8_t q) { return q > 15; })) {
        throw InvalidArgument(std::string(op) + ": a 4-bit q_t holds values 0..15, row " +
                              std::to_string(i) + " has more");
      }
    }
  }
}

// Columns [first, first + width) of q_t/scale_t/offset_t as one quantized panel at dst;
// the columns past width are zero (so they widen to zero).
void pack_quantized_panel(uint8_t* dst, const TensorView& q_t, const TensorView& scale_t,
                          const TensorView& offset_t, int64_t first, int64_t width, int bits) {
  const auto* q = static_cast<const uint8_t*>(q_t.data);
  const int64_t k = q_t.shape[0];
  for (int64_t b = 0; b < k / kQuantBlock; ++b) {
    uint8_t* block = dst + b * quantized_block_bytes(bits);
    std::memset(block, 0, static_cast<size_t>(quantized_block_bytes(bits)));
    auto* params = reinterpret_cast<float*>(block);
    for (int64_t j = 0; j < width; ++j) {
      params[j] = static_cast<const float*>(scale_t.data)[b * scale_t.strides[0] + first + j];
      params[kPanelWidth + j] =
          static_cast<const float*>(offset_t.data)[b * offset_t.strides[0] + first + j];
    }
    uint8_t* ints = block + kQuantParamBytes;
    for (int64_t i = 0; i < kQuantBlock; ++i) {
      const uint8_t* row = q + (b * kQuantBlock + i) * q_t.strides[0] + first;
      for (int64_t j = 0; j < width; ++j) {
        if (bits == 8) {
          ints[i * kPanelWidth + j] = row[j];
        } else {
          ints[i / 2 * kPanelWidth + j] |= static_cast<uint8_t>(row[j] << (i % 2 * 4));
        }
      }
    }
  }
}

}  // namespace

int64_t packed_quantized_weight_size(int64_t k, int64_t n, int bits) {
  if (bits != 4 && bits != 8) {
    throw InvalidArgument("packed_quantized_weight_size: bits must be 4 or 8, got " +
                          std::to_string(bits));
  }
  if (k % kQuantBlock != 0) {
    throw InvalidArgument("packed_quantized_weight_size: k must be a multiple of " +
                          std::to_string(kQuantBlock) + ", got " + std::to_string(k));
  }
  return (n + kPanelWidth - 1) / kPanelWidth * (k / kQuantBlock) * quantized_block_bytes(bits);
}

void pack_quantized_weight(const TensorView& packed, const TensorView& q_t,
                           const TensorView& scale_t, const TensorView& offset_t, bool gate_up) {
  check_quantized_args("pack_quantized_weight", packed, q_t, scale_t, offset_t, gate_up);
  const int bits = detail::quantized_bits(packed.dtype);
  const int64_t k = q_t.shape[0], n = gate_up ? q_t.shape[1] / 2 : q_t.shape[1];
  const int64_t panel_bytes = packed_quantized_weight_size(k, kPanelWidth, bits);
  auto* dst = static_cast<uint8_t*>(packed.data);
  detail::for_each_packed_panel(n, gate_up, [&](int64_t slot, int64_t first, int64_t width) {
    pack_quantized_panel(dst + slot * panel_bytes, q_t, scale_t, offset_t, first, width, bits);
  });
}

namespace {

// One row of 16 columns: q * scale + offset, from 16 int8 / the 16 nibbles of a row pair.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PYENGINE_WIDEN_AVX512 __attribute__((target("avx512f,avx512bw")))
// GCC 12 takes the intrinsics' undefined pass-through vectors for uninitialized reads.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
PYENGINE_WIDEN_AVX512 void widen_block_avx512(const uint8_t* block, int bits, float* out) {
  const uint8_t* ints = block + kQuantParamBytes;
  for (int v = 0; v < kPanelWidth / kLanes; ++v) {
    const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(block) + v * kLanes);
    const __m512 offset =
        _mm512_loadu_ps(reinterpret_cast<const float*>(block) + kPanelWidth + v * kLanes);
    float* dst = out + v * kLanes;
    const uint8_t* src = ints + v * kLanes;
    if (bits == 8) {
      for (int64_t i = 0; i < kQuantBlock; ++i) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * kPanelWidth));
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
        _mm512_storeu_ps(dst + i * kPanelWidth, _mm512_fmadd_ps(w, scale, offset));
      }
    } else {
      const __m512i low_bits = _mm512_set1_epi32(15);
      for (int64_t i = 0; i < kQuantBlock / 2; ++i) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * kPanelWidth));
        const __m512i pair = _mm512_cvtepu8_epi32(q);
        const __m512 low = _mm512_cvtepi32_ps(_mm512_and_si512(pair, low_bits));
        const __m512 high = _mm512_cvtepi32_ps(_mm512_srli_epi32(pair, 4));
        _mm512_storeu_ps(dst + 2 * i * kPanelWidth, _mm512_fmadd_ps(low, scale, offset));
        _mm512_storeu_ps(dst + (2 * i + 1) * kPanelWidth, _mm512_fmadd_ps(high, scale, offset));
      }
    }
  }
}
#pragma GCC diagnostic pop
#endif

void widen_block_generic(const uint8_t* block, int bits, float* out) {
  const auto* scale = reinterpret_cast<const float*>(block);
  const float* offset = scale + kPanelWidth;
  const uint8_t* ints = block + kQuantParamBytes;
  for (int64_t i = 0; i < kQuantBlock; ++i) {
    for (int64_t j = 0; j < kPanelWidth; ++j) {
      const int q = bits == 8 ? static_cast<int8_t>(ints[i * kPanelWidth + j])
                              : ints[i / 2 * kPanelWidth + j] >> (i % 2 * 4) & 15;
      out[i * kPanelWidth + j] = static_cast<float>(q) * scale[j] + offset[j];
    }
  }
}

using WidenBlock = void (*)(const uint8_t*, int, float*);

WidenBlock pick_widen_block() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
    return widen_block_avx512;
  }
#endif
  return widen_block_generic;
}

}  // namespace

namespace detail {

// (q * scale is exact, pack_quantized_weight checks: a multiply-add rounds as the
// product, then the sum.)
void widen_quantized_panel(const uint8_t* src, int64_t k, int bits, float* dst) {
  static const WidenBlock widen_block = pick_widen_block();
  const int64_t block_bytes = quantized_block_bytes(bits);
  for (int64_t b = 0; b < k / kQuantBlock; ++b) {
    // The quantized rows are read once, in order: ask for them kPrefetchBlocks ahead (past
    // the panel, into the thread's next one; prefetches never fault).
    const uint8_t* ahead = src + (b + kPrefetchBlocks) * block_bytes;
    for (int64_t line = 0; line < block_bytes; line += 64) __builtin_prefetch(ahead + line, 0, 1);
    widen_block(src + b * block_bytes, bits, dst + b * kQuantBlock * kPanelWidth);
  }
}

}  // namespace detail
}  // namespace pyengine
