// The portable build of the few-row products over quantized panels (see
// quantized_panel.h, multiply_quantized_rows). Its own file, compiled with multiply-add
// fusion as dense.cpp is (quantized_panel.cpp is not): its sums must round as the float32
// panels' tiles do in each vector width's clone.
#include <cstring>

#include "quantized_panel.h"
#include "vector_clones.h"

namespace pyengine::detail {
namespace {

// The portable build of the few-row products: passes of 16 columns, as a vector type of
// the compiler's, each weight widened as widen_block_portable widens it. Cloned per
// vector width like the float32 panels' tiles, and of their vectors' width, so that its
// multiply-adds fuse, or not, as theirs do: the same bits. (8-float vectors did not fuse
// in the AVX-512 clone: without AVX512VL, FMA there is for 16 floats.)
constexpr int kPortableColumns = 16;
using Vec16 = float __attribute__((vector_size(kPortableColumns * sizeof(float))));

template <int kRows, QuantCode kCode>
PYENGINE_VECTOR_CLONES void rows_portable(const float* a, int64_t lda, const uint8_t* panel,
                                          int64_t k, QuantParams params, float* c) {
  const QuantForm form{kCode, params};
  const int64_t block_bytes = quantized_block_bytes(form);
  constexpr int64_t kGroupRows = quantized_group_rows(kCode);
  constexpr int kLaneRows = quantized_lane_rows(kCode);
  for (int64_t j0 = 0; j0 < kPanelWidth; j0 += kPortableColumns) {
    Vec16 acc[kRows] = {}, odd = {};
    for (int64_t b = 0; b < k / kQuantBlock; ++b) {
      const uint8_t* block = panel + b * block_bytes;
      if (j0 == 0) prefetch_quantized_ahead(block, block_bytes);
      const uint8_t* ints = block + quantized_param_bytes(form);
      Vec16 scale = {}, offset = {};
      for (int64_t i0 = 0; i0 < kQuantBlock; i0 += kLaneRows) {
        if (i0 % kGroupRows == 0) {
          for (int j = 0; j < kPortableColumns; ++j) {
            scale[j] = quantized_scale(block, i0, j0 + j, form);
            offset[j] = quantized_offset(block, i0, j0 + j, form);
          }
        }
        uint32_t lanes[kPortableColumns];
        std::memcpy(lanes, ints + (i0 / kLaneRows * kPanelWidth + j0) * 4, sizeof lanes);
        if constexpr (quantized_biased(kCode)) {
          for (uint32_t& lane : lanes) lane ^= 0x80808080u;
        }
#pragma GCC unroll 8
        for (int r = 0; r < kLaneRows; ++r) {
          float q[kPortableColumns];
          for (int j = 0; j < kPortableColumns; ++j) {
            q[j] = quantized_lane_value<kCode>(lanes[j], r);
          }
          Vec16 w;
          std::memcpy(&w, q, sizeof w);
          w = w * scale + offset;
          const float* x = a + b * kQuantBlock + i0 + r;
          for (int row = 0; row < kRows; ++row) {
            if (kRows == 1 && r % 2 == 1) {
              odd += x[0] * w;
            } else {
              acc[row] += x[row * lda] * w;
            }
          }
        }
      }
    }
    for (int row = 0; row < kRows; ++row) {
      const Vec16 sum = kRows == 1 ? acc[0] + odd : acc[row];
      std::memcpy(c + row * kPanelWidth + j0, &sum, sizeof sum);
    }
  }
}

}  // namespace

template <QuantCode kCode>
void multiply_rows_portable(const float* a, int64_t lda, int rows, const uint8_t* panel,
                            int64_t k, QuantParams params, float* c) {
  with_register_rows(rows, [&](auto n) {
    rows_portable<decltype(n)::value, kCode>(a, lda, panel, k, params, c);
  });
}


template void multiply_rows_portable<QuantCode::kNibble>(const float*, int64_t, int,
                                                         const uint8_t*, int64_t, QuantParams,
                                                         float*);
template void multiply_rows_portable<QuantCode::kInt8>(const float*, int64_t, int, const uint8_t*,
                                                       int64_t, QuantParams, float*);
template void multiply_rows_portable<QuantCode::kInt8Halves>(const float*, int64_t, int,
                                                             const uint8_t*, int64_t,
                                                             QuantParams, float*);
template void multiply_rows_portable<QuantCode::kFp8>(const float*, int64_t, int, const uint8_t*,
                                                      int64_t, QuantParams, float*);

}  // namespace pyengine::detail
