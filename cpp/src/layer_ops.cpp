// Fused per-token layers (see pyengine/layer_ops.h). Rows are independent: OpenMP over
// tokens once a call has enough of them to pay for the threads.
#include "pyengine/layer_ops.h"

#include <cmath>
#include <string>

#include "attention_checks.h"
#include "float_convert.h"

namespace pyengine {
namespace {

using detail::arg;

constexpr int64_t kParallelElements = 1 << 15;

// A 2-d [rows, cols] view's element (r, i), any dtype, dense last dim.
template <DType kDType>
struct Rows {
  void* data;
  int64_t stride;
  float get(int64_t r, int64_t i) const { return detail::load<kDType>(data, r * stride + i); }
  void set(int64_t r, int64_t i, float v) const { detail::store<kDType>(data, r * stride + i, v); }
};

void check_rows(const TensorView& t, const char* op, const char* name, int ndim, DType dtype) {
  detail::check_cpu(t, op, name);
  detail::check_shape(t, op, name, ndim);
  detail::check_dtype(t, dtype, op, name);
  if (t.strides[ndim - 1] != 1) throw InvalidArgument(arg(op, name) + " needs a dense last dim");
  if (ndim == 3 && t.strides[1] != t.shape[2]) {
    throw InvalidArgument(arg(op, name) + " must have dense heads ([tokens, heads, d] rows)");
  }
}

void check_float_dtype(const TensorView& t, const char* op, const char* name) {
  if (!detail::is_cache_dtype(t.dtype)) {
    throw InvalidArgument(arg(op, name) + " must be float32, float16 or bfloat16, got " +
                          t.describe());
  }
}

template <class F>
void dispatch(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f(std::integral_constant<DType, DType::kFloat32>{});
    case DType::kFloat16: return f(std::integral_constant<DType, DType::kFloat16>{});
    case DType::kBFloat16: return f(std::integral_constant<DType, DType::kBFloat16>{});
    default: return;  // checked by the callers
  }
}

void check_norm_args(const char* op, const TensorView& x, const TensorView& other,
                     const char* other_name, const TensorView& weight, float eps) {
  check_float_dtype(x, op, "x");
  check_rows(x, op, "x", 2, x.dtype);
  check_rows(other, op, other_name, 2, x.dtype);
  check_rows(weight, op, "weight", 1, x.dtype);
  if (other.shape[0] != x.shape[0] || other.shape[1] != x.shape[1] ||
      weight.shape[0] != x.shape[1]) {
    throw InvalidArgument(std::string(op) + ": x " + x.describe() + ", " + other_name + " " +
                          other.describe() + " and weight " + weight.describe() +
                          " disagree in shape");
  }
  if (!(eps > 0) || !std::isfinite(eps)) throw InvalidArgument(std::string(op) + ": eps must be > 0");
}

// 1 / sqrt(mean of squares) of row r of `sum_of` (a callable giving element i), in the
// way torch rounds x.pow(2).mean(-1): float squares, summed in double, then float.
template <class Get>
float inverse_rms(Get&& value, int64_t n, float eps) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = value(i);
    sum += static_cast<double>(v * v);
  }
  const auto mean = static_cast<float>(sum / static_cast<double>(n));
  return 1.0f / std::sqrt(mean + eps);
}

}  // namespace

void rms_norm(const TensorView& out, const TensorView& x, const TensorView& weight, float eps) {
  check_norm_args("rms_norm", x, out, "out", weight, eps);
  const int64_t rows = x.shape[0], n = x.shape[1];
  dispatch(x.dtype, [&](auto d) {
    constexpr DType kD = decltype(d)::value;
    const Rows<kD> in{x.data, x.strides[0]}, dst{out.data, out.strides[0]};
#pragma omp parallel for schedule(static) if (rows * n >= kParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = inverse_rms([&](int64_t i) { return in.get(r, i); }, n, eps);
      for (int64_t i = 0; i < n; ++i) {
        dst.set(r, i, detail::load<kD>(weight.data, i) * (in.get(r, i) * inv));
      }
    }
  });
}

void fused_add_rms_norm(const TensorView& x, const TensorView& residual, const TensorView& weight,
                        float eps) {
  check_norm_args("fused_add_rms_norm", x, residual, "residual", weight, eps);
  const int64_t rows = x.shape[0], n = x.shape[1];
  dispatch(x.dtype, [&](auto d) {
    constexpr DType kD = decltype(d)::value;
    const Rows<kD> xs{x.data, x.strides[0]}, res{residual.data, residual.strides[0]};
#pragma omp parallel for schedule(static) if (rows * n >= kParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < n; ++i) res.set(r, i, res.get(r, i) + xs.get(r, i));
      const float inv = inverse_rms([&](int64_t i) { return res.get(r, i); }, n, eps);
      for (int64_t i = 0; i < n; ++i) {
        xs.set(r, i, detail::load<kD>(weight.data, i) * (res.get(r, i) * inv));
      }
    }
  });
}

void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView& cos_sin_cache) {
  constexpr const char* op = "rotary_embedding";
  check_float_dtype(query, op, "query");
  check_rows(query, op, "query", 3, query.dtype);
  check_rows(key, op, "key", 3, query.dtype);
  check_rows(cos_sin_cache, op, "cos_sin_cache", 2, DType::kFloat32);
  detail::check_cpu(positions, op, "positions");
  detail::check_shape(positions, op, "positions", 1);
  if (positions.dtype != DType::kInt32 && positions.dtype != DType::kInt64) {
    throw InvalidArgument(arg(op, "positions") + " must be int32 or int64, got " +
                          positions.describe());
  }
  const int64_t tokens = query.shape[0], d = query.shape[2];
  if (key.shape[0] != tokens || positions.shape[0] != tokens || key.shape[2] != d ||
      cos_sin_cache.shape[1] != d || d % 2 != 0) {
    throw InvalidArgument(std::string(op) + ": query " + query.describe() + ", key " +
                          key.describe() + ", positions " + positions.describe() +
                          " and cos_sin_cache " + cos_sin_cache.describe() +
                          " disagree (need [tokens, heads, d], [tokens], [max_positions, d])");
  }
  const int64_t max_positions = cos_sin_cache.shape[0];
  const auto position = [&](int64_t t) -> int64_t {
    const int64_t i = t * positions.strides[0];
    return positions.dtype == DType::kInt32 ? static_cast<const int32_t*>(positions.data)[i]
                                            : static_cast<const int64_t*>(positions.data)[i];
  };
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t p = position(t);
    if (p < 0 || p >= max_positions) {
      throw InvalidArgument(std::string(op) + ": positions[" + std::to_string(t) + "] = " +
                            std::to_string(p) + " is outside [0, " +
                            std::to_string(max_positions) + ")");
    }
  }
  const int64_t half = d / 2;
  const auto* table = static_cast<const float*>(cos_sin_cache.data);
  dispatch(query.dtype, [&](auto dt) {
    constexpr DType kD = decltype(dt)::value;
    const auto rotate = [&](const TensorView& x, int64_t t, const float* cs) {
      for (int64_t h = 0; h < x.shape[1]; ++h) {
        const int64_t base = t * x.strides[0] + h * x.strides[1];
        for (int64_t i = 0; i < half; ++i) {
          const float a = detail::load<kD>(x.data, base + i);
          const float b = detail::load<kD>(x.data, base + half + i);
          const float c = cs[i], s = cs[half + i];
          detail::store<kD>(x.data, base + i, a * c + (-b) * s);
          detail::store<kD>(x.data, base + half + i, b * c + a * s);
        }
      }
    };
#pragma omp parallel for schedule(static) if (tokens * query.shape[1] * d >= kParallelElements)
    for (int64_t t = 0; t < tokens; ++t) {
      const float* cs = table + position(t) * cos_sin_cache.strides[0];
      rotate(query, t, cs);
      rotate(key, t, cs);
    }
  });
}

void silu_and_mul(const TensorView& out, const TensorView& x) {
  constexpr const char* op = "silu_and_mul";
  check_float_dtype(x, op, "x");
  check_rows(x, op, "x", 2, x.dtype);
  check_rows(out, op, "out", 2, x.dtype);
  const int64_t rows = x.shape[0], n = out.shape[1];
  if (out.shape[0] != rows || x.shape[1] != 2 * n) {
    throw InvalidArgument(std::string(op) + ": need x [tokens, 2n] and out [tokens, n], got x " +
                          x.describe() + " and out " + out.describe());
  }
  dispatch(x.dtype, [&](auto d) {
    constexpr DType kD = decltype(d)::value;
    const Rows<kD> in{x.data, x.strides[0]}, dst{out.data, out.strides[0]};
#pragma omp parallel for schedule(static) if (rows * n >= kParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < n; ++i) {
        const float gate = in.get(r, i);
        dst.set(r, i, gate / (1.0f + std::exp(-gate)) * in.get(r, n + i));
      }
    }
  });
}

}  // namespace pyengine
