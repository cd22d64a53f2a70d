// fp8 e4m3 activation quantization (see pyengine/fp8_quantize.h), in loops the compiler
// vectorizes: the rounding is integer arithmetic on the float's bits, no branch.
#include "pyengine/fp8_quantize.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "float_convert.h"
#include "tensor_checks.h"
#include "vector_clones.h"

namespace pyengine {
namespace {

constexpr float kFp8Max = 448.0f;

// v (|v| <= 448) rounded to the nearest e4m3 value, ties to even. From 2^-6 up (normal
// e4m3) the float's 20 low mantissa bits are rounded away; below, e4m3's steps are
// 2^-9, which adding 2^14 (whose float32 step that is) rounds to.
inline float round_to_e4m3(float v) {
  const uint32_t bits = detail::float_to_bits(v);
  const uint32_t sign = bits & 0x80000000u, abs = bits ^ sign;
  const uint32_t normal = (abs + 0x7FFFFu + ((abs >> 20) & 1u)) & 0xFFF00000u;
  const float small = (detail::bits_to_float(abs) + 16384.0f) - 16384.0f;
  const uint32_t rounded = abs < 0x3C800000u ? detail::float_to_bits(small) : normal;
  return detail::bits_to_float(rounded | sign);
}

PYENGINE_VECTOR_CLONES float row_max_abs(const float* x, int64_t k) {
  return detail::max_abs(x, k);
}

PYENGINE_VECTOR_CLONES void quantize_row(const float* x, int64_t k, float s, float* out) {
  if (s == 0.0f) {
    std::fill(out, out + k, 0.0f);
    return;
  }
  for (int64_t i = 0; i < k; ++i) {
    out[i] = round_to_e4m3(std::clamp(x[i] / s, -kFp8Max, kFp8Max)) * s;
  }
}

}  // namespace

void quantize_fp8_rows(const TensorView& out, const TensorView& x, const TensorView& scale) {
  constexpr const char* op = "quantize_fp8_rows";
  detail::check_rows(x, op, "x", 2, DType::kFloat32);
  detail::check_x_out(op, out, x, x.shape[1]);
  float static_scale = -1.0f;  // dynamic
  if (scale.data != nullptr) {
    detail::check_vector(scale, op, "scale", 1);
    static_scale = *static_cast<const float*>(scale.data);
    if (!(static_scale > 0.0f) || !std::isfinite(static_scale)) {
      throw InvalidArgument(detail::arg(op, "scale") + " must be finite and positive, got " +
                            std::to_string(static_scale));
    }
  }
  const int64_t m = x.shape[0], k = x.shape[1];
  const auto* src = static_cast<const float*>(x.data);
  auto* dst = static_cast<float*>(out.data);
#pragma omp parallel for if (m * k >= (1 << 14))
  for (int64_t r = 0; r < m; ++r) {
    const float* row = src + r * x.strides[0];
    const float s = static_scale >= 0.0f ? static_scale : row_max_abs(row, k) / kFp8Max;
    quantize_row(row, k, s, dst + r * out.strides[0]);
  }
}

}  // namespace pyengine
