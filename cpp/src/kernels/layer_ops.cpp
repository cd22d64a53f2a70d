// Fused per-token layers (see pyengine/layer_ops.h). Rows are independent: OpenMP over
// tokens once a call has enough of them to pay for the threads.
#include "pyengine/layer_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "activation.h"
#include "float_convert.h"
#include "tensor_checks.h"
#include "vector_clones.h"
#ifdef PYENGINE_WITH_CUDA
#include "cuda/layer_kernels_launch.h"
#endif

namespace pyengine {
namespace {

using detail::arg;
using detail::check_rows_on;
using detail::on_cuda;

constexpr int64_t kParallelElements = 1 << 15;

// A 2-d [rows, cols] view's element (r, i), any dtype, dense last dim.
template <DType kDType>
struct Rows {
  void* data;
  int64_t stride;
  float get(int64_t r, int64_t i) const { return detail::load<kDType>(data, r * stride + i); }
  void set(int64_t r, int64_t i, float v) const { detail::store<kDType>(data, r * stride + i, v); }
};

void check_float_dtype(const TensorView& t, const char* op, const char* name) {
  if (t.dtype != DType::kFloat32 && t.dtype != DType::kFloat16 && t.dtype != DType::kBFloat16) {
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

// x and other [rows, n], or (`heads`: on the CPU) [tokens, heads, n] with dense heads, a
// row a head (Qwen3's q/k norms); weight [n].
void check_norm_args(const char* op, const TensorView& x, const TensorView& other,
                     const char* other_name, const TensorView& weight, float eps, bool writes_x,
                     bool heads = false) {
  check_float_dtype(x, op, "x");
  if (x.ndim == 3 && heads && x.device.kind != DeviceKind::kCPU) {
    throw InvalidArgument(std::string(op) + ": [tokens, heads, n] rows run on the CPU only, " +
                          "got x " + x.describe());
  }
  const int ndim = heads && x.ndim == 3 ? 3 : 2;
  check_rows_on(x, x.device, op, "x", ndim, x.dtype);
  check_rows_on(other, x.device, op, other_name, ndim, x.dtype);
  check_rows_on(weight, x.device, op, "weight", 1, x.dtype);
  detail::check_writable(other, op, other_name);
  if (writes_x) detail::check_writable(x, op, "x");
  bool same = weight.shape[0] == x.shape[ndim - 1];
  for (int d = 0; d < ndim; ++d) same = same && other.shape[d] == x.shape[d];
  if (!same) {
    throw InvalidArgument(std::string(op) + ": x " + x.describe() + ", " + other_name + " " +
                          other.describe() + " and weight " + weight.describe() +
                          " disagree in shape");
  }
  if (!(eps > 0) || !std::isfinite(eps))
    throw InvalidArgument(std::string(op) + ": eps must be > 0");
}

// out = in / sqrt(mean(in^2) + eps) * weight for one float32 row, rounding as torch's
// x.pow(2).mean(-1): float squares, summed (here in double), then float.
PYENGINE_VECTOR_CLONES
void rms_norm_row(const float* __restrict in, const float* __restrict weight, float* __restrict out,
                  int64_t n, float eps) {
  double sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(in[i] * in[i]);
  const float inv = 1.0f / std::sqrt(static_cast<float>(sum / static_cast<double>(n)) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (in[i] * inv);
}

PYENGINE_VECTOR_CLONES
void add_row(float* __restrict acc, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += x[i];
}

// The first element of row r of a [rows, n] view, or of a [tokens, heads, n] one with
// dense heads (row r: token r / heads, head r % heads).
int64_t row_start(const TensorView& t, int64_t r) {
  if (t.ndim == 3) return r / t.shape[1] * t.strides[0] + r % t.shape[1] * t.shape[2];
  return r * t.strides[0];
}

// Row r (row_start) as float32: the row itself for float32 tensors, else a copy in
// `buffer` (written back by store_row).
template <DType kD>
float* load_row(const TensorView& t, int64_t r, int64_t n, float* buffer) {
  if constexpr (kD == DType::kFloat32) {
    return static_cast<float*>(t.data) + row_start(t, r);
  } else {
    const int64_t start = row_start(t, r);
    for (int64_t i = 0; i < n; ++i) buffer[i] = detail::load<kD>(t.data, start + i);
    return buffer;
  }
}

template <DType kD>
void store_row(const TensorView& t, int64_t r, int64_t n, const float* row) {
  if constexpr (kD != DType::kFloat32) {
    const int64_t start = row_start(t, r);
    for (int64_t i = 0; i < n; ++i) detail::store<kD>(t.data, start + i, row[i]);
  } else {
    (void)t, (void)r, (void)n, (void)row;  // float32 rows were written in place
  }
}

template <DType kD>
std::vector<float> weight_as_float(const TensorView& weight, int64_t n) {
  std::vector<float> w(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) w[static_cast<size_t>(i)] = detail::load<kD>(weight.data, i);
  return w;
}

// Per-thread row buffers for 16-bit tensors, grown once.
float* row_buffer(int64_t floats) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < static_cast<size_t>(floats)) buffer.resize(static_cast<size_t>(floats));
  return buffer.data();
}

}  // namespace

namespace {

// body(row, a per-thread buffer of 2n floats, the weight as float32) for every row, on
// the threads once there are enough rows.
template <DType kD, class Body>
void for_each_norm_row(const TensorView& weight, int64_t rows, int64_t n, Body&& body) {
  const std::vector<float> w = weight_as_float<kD>(weight, n);
#pragma omp parallel for schedule(static) if (rows * n >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) body(r, row_buffer(2 * n), w.data());
}

}  // namespace

void rms_norm(const TensorView& out, const TensorView& x, const TensorView& weight, float eps,
              void* stream) {
  check_norm_args("rms_norm", x, out, "out", weight, eps, false, true);
  if (on_cuda(x.device, "rms_norm")) {
#ifdef PYENGINE_WITH_CUDA
    return cuda::rms_norm(out, x, weight, eps, stream);
#endif
  }
  (void)stream;
  const int64_t n = x.shape[x.ndim - 1];
  const int64_t rows = x.ndim == 3 ? x.shape[0] * x.shape[1] : x.shape[0];
  dispatch(x.dtype, [&](auto d) {
    constexpr DType kD = decltype(d)::value;
    for_each_norm_row<kD>(weight, rows, n, [&](int64_t r, float* buffer, const float* w) {
      const float* in = load_row<kD>(x, r, n, buffer);
      float* dst =
          kD == DType::kFloat32 ? static_cast<float*>(out.data) + row_start(out, r) : buffer + n;
      rms_norm_row(in, w, dst, n, eps);
      store_row<kD>(out, r, n, dst);
    });
  });
}

void fused_add_rms_norm(const TensorView& x, const TensorView& residual, const TensorView& weight,
                        float eps, void* stream) {
  check_norm_args("fused_add_rms_norm", x, residual, "residual", weight, eps, true);
  if (on_cuda(x.device, "fused_add_rms_norm")) {
#ifdef PYENGINE_WITH_CUDA
    return cuda::fused_add_rms_norm(x, residual, weight, eps, stream);
#endif
  }
  (void)stream;
  const int64_t n = x.shape[1];
  dispatch(x.dtype, [&](auto d) {
    constexpr DType kD = decltype(d)::value;
    for_each_norm_row<kD>(weight, x.shape[0], n, [&](int64_t r, float* buffer, const float* w) {
      float* xs = load_row<kD>(x, r, n, buffer);
      float* res = load_row<kD>(residual, r, n, buffer + n);
      add_row(res, xs, n);
      rms_norm_row(res, w, xs, n, eps);
      store_row<kD>(residual, r, n, res);
      store_row<kD>(x, r, n, xs);
    });
  });
}

namespace {

// A CPU-only op's float rows `in` and the rows `out` it writes, of in's dtype.
void check_cpu_rows(const char* op, const TensorView& in, const char* in_name,
                    const TensorView& out) {
  check_float_dtype(in, op, in_name);
  detail::check_cpu(in, op, in_name);
  check_rows_on(in, in.device, op, in_name, 2, in.dtype);
  check_rows_on(out, in.device, op, "out", 2, in.dtype);
  detail::check_writable(out, op, "out");
}

}  // namespace

void add(const TensorView& out, const TensorView& a, const TensorView& b) {
  constexpr const char* op = "add";
  check_cpu_rows(op, a, "a", out);
  check_rows_on(b, a.device, op, "b", 2, a.dtype);
  if (b.shape[0] != a.shape[0] || b.shape[1] != a.shape[1] || out.shape[0] != a.shape[0] ||
      out.shape[1] != a.shape[1]) {
    throw InvalidArgument(std::string(op) + ": out " + out.describe() + ", a " + a.describe() +
                          " and b " + b.describe() + " disagree in shape");
  }
  const int64_t rows = a.shape[0], n = a.shape[1];
  dispatch(a.dtype, [&](auto d) {
    constexpr DType kD = decltype(d)::value;
    const Rows<kD> x{a.data, a.strides[0]}, y{b.data, b.strides[0]}, sum{out.data, out.strides[0]};
#pragma omp parallel for schedule(static) if (rows * n >= kParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < n; ++i) sum.set(r, i, x.get(r, i) + y.get(r, i));
    }
  });
}

void embedding(const TensorView& out, const TensorView& weight, const TensorView& ids) {
  constexpr const char* op = "embedding";
  check_cpu_rows(op, weight, "weight", out);
  detail::check_cpu(ids, op, "ids");
  const int64_t tokens = out.shape[0], vocab = weight.shape[0], n = weight.shape[1];
  if ((ids.dtype != DType::kInt32 && ids.dtype != DType::kInt64) || ids.ndim != 1 ||
      ids.shape[0] != tokens || out.shape[1] != n) {
    throw InvalidArgument(std::string(op) + ": need ids int32 or int64 [tokens], out [tokens, " +
                          std::to_string(n) + "], got ids " + ids.describe() + " and out " +
                          out.describe());
  }
  detail::check_indices(ids, vocab, op, "ids");
  const auto element = static_cast<int64_t>(weight.element_size());
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t row = detail::index_at(ids, t);
    std::memcpy(static_cast<char*>(out.data) + t * out.strides[0] * element,
                static_cast<const char*>(weight.data) + row * weight.strides[0] * element,
                static_cast<size_t>(n * element));
  }
}

void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView& cos_sin_cache, bool is_neox, void* stream) {
  constexpr const char* op = "rotary_embedding";
  check_float_dtype(query, op, "query");
  check_rows_on(query, query.device, op, "query", 3, query.dtype);
  check_rows_on(key, query.device, op, "key", 3, query.dtype);
  check_rows_on(cos_sin_cache, query.device, op, "cos_sin_cache", 2, DType::kFloat32);
  detail::check_writable(query, op, "query");
  detail::check_writable(key, op, "key");
  detail::check_device(positions, query.device, op, "positions");
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
  // The positions stay on the device: see cuda/layer_kernels_launch.h.
  if (on_cuda(query.device, op)) {
#ifdef PYENGINE_WITH_CUDA
    return cuda::rotary_embedding(positions, query, key, cos_sin_cache, is_neox, stream);
#endif
  }
  (void)stream;
  const int64_t max_positions = cos_sin_cache.shape[0];
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t p = detail::index_at(positions, t);
    if (p < 0 || p >= max_positions) {
      throw InvalidArgument(std::string(op) + ": positions[" + std::to_string(t) +
                            "] = " + std::to_string(p) + " is outside [0, " +
                            std::to_string(max_positions) + ")");
    }
  }
  const int64_t half = d / 2;
  // The pair of frequency i: (i, half + i) rotate-half, (2i, 2i + 1) interleaved.
  const int64_t first_step = is_neox ? 1 : 2, second_offset = is_neox ? half : 1;
  const auto* table = static_cast<const float*>(cos_sin_cache.data);
  dispatch(query.dtype, [&](auto dt) {
    constexpr DType kD = decltype(dt)::value;
    const auto rotate = [&](const TensorView& x, int64_t t, const float* cs) {
      for (int64_t h = 0; h < x.shape[1]; ++h) {
        const int64_t base = t * x.strides[0] + h * x.strides[1];
        for (int64_t i = 0; i < half; ++i) {
          const int64_t j = base + i * first_step, k = j + second_offset;
          const float a = detail::load<kD>(x.data, j), b = detail::load<kD>(x.data, k);
          const float c = cs[i], s = cs[half + i];
          detail::store<kD>(x.data, j, a * c + (-b) * s);
          detail::store<kD>(x.data, k, b * c + a * s);
        }
      }
    };
#pragma omp parallel for schedule(static) if (tokens * query.shape[1] * d >= kParallelElements)
    for (int64_t t = 0; t < tokens; ++t) {
      const float* cs = table + detail::index_at(positions, t) * cos_sin_cache.strides[0];
      rotate(query, t, cs);
      rotate(key, t, cs);
    }
  });
}

namespace detail {

PYENGINE_VECTOR_CLONES
void silu_and_mul_row(const float* __restrict gate, const float* __restrict up,
                      float* __restrict out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + exp_clamped(-gate[i])) * up[i];
}

// gelu(gate) * up, gelu's tanh approximation (torch's approximate="tanh"). tanh(u) is
// taken as 1 - 2 / (exp(2u) + 1) through the branch-free exp, so that the loop
// vectorizes (libm's tanhf, a call an element, took a third of a Gemma step).
PYENGINE_VECTOR_CLONES
void gelu_tanh_and_mul_row(const float* __restrict gate, const float* __restrict up,
                           float* __restrict out, int64_t n) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f, kCubic = 0.044715f;
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float u = kSqrt2OverPi * (g + kCubic * g * g * g);
    const float tanh_u = 1.0f - 2.0f / (exp_clamped(2.0f * u) + 1.0f);
    out[i] = 0.5f * g * (1.0f + tanh_u) * up[i];
  }
}

}  // namespace detail

namespace {

// x [tokens, 2n] ([gate | up] a row) and out [tokens, n] of one float dtype on one device.
void check_gated(const char* op, const TensorView& out, const TensorView& x) {
  check_float_dtype(x, op, "x");
  check_rows_on(x, x.device, op, "x", 2, x.dtype);
  check_rows_on(out, x.device, op, "out", 2, x.dtype);
  detail::check_writable(out, op, "out");
  if (out.shape[0] != x.shape[0] || x.shape[1] != 2 * out.shape[1]) {
    throw InvalidArgument(std::string(op) + ": need x [tokens, 2n] and out [tokens, n], got x " +
                          x.describe() + " and out " + out.describe());
  }
}

// out = activation(gate) * up a row on the CPU, each row through `row_fn` in float32.
template <class Row>
void gated_rows(const TensorView& out, const TensorView& x, const Row& row_fn) {
  const int64_t rows = x.shape[0], n = out.shape[1];
  dispatch(x.dtype, [&](auto d) {
    constexpr DType kD = decltype(d)::value;
#pragma omp parallel for schedule(static) if (rows * n >= kParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      if constexpr (kD == DType::kFloat32) {
        const float* in = static_cast<const float*>(x.data) + r * x.strides[0];
        row_fn(in, in + n, static_cast<float*>(out.data) + r * out.strides[0], n);
      } else {
        thread_local std::vector<float> row;
        row.resize(static_cast<size_t>(3 * n));
        for (int64_t i = 0; i < 2 * n; ++i) {
          row[static_cast<size_t>(i)] = detail::load<kD>(x.data, r * x.strides[0] + i);
        }
        row_fn(row.data(), row.data() + n, row.data() + 2 * n, n);
        for (int64_t i = 0; i < n; ++i) {
          detail::store<kD>(out.data, r * out.strides[0] + i, row[static_cast<size_t>(2 * n + i)]);
        }
      }
    }
  });
}

}  // namespace

void silu_and_mul(const TensorView& out, const TensorView& x, void* stream) {
  constexpr const char* op = "silu_and_mul";
  check_gated(op, out, x);
  if (on_cuda(x.device, op)) {
#ifdef PYENGINE_WITH_CUDA
    return cuda::silu_and_mul(out, x, stream);
#endif
  }
  (void)stream;
  gated_rows(out, x, detail::silu_and_mul_row);
}

void gelu_tanh_and_mul(const TensorView& out, const TensorView& x) {
  constexpr const char* op = "gelu_tanh_and_mul";
  detail::check_cpu(x, op, "x");
  check_gated(op, out, x);
  gated_rows(out, x, detail::gelu_tanh_and_mul_row);
}

void scale(const TensorView& out, const TensorView& x, double factor) {
  constexpr const char* op = "scale";
  check_cpu_rows(op, x, "x", out);
  const int64_t rows = x.shape[0], n = x.shape[1];
  if (out.shape[0] != rows || out.shape[1] != n) {
    throw InvalidArgument(arg(op, "out") + " must be x's shape, got x " + x.describe() +
                          " and out " + out.describe());
  }
  const auto f = static_cast<float>(factor);
  dispatch(x.dtype, [&](auto d) {
    constexpr DType kD = decltype(d)::value;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < n; ++i) {
        const float v = detail::load<kD>(x.data, r * x.strides[0] + i) * f;
        detail::store<kD>(out.data, r * out.strides[0] + i, v);
      }
    }
  });
}

}  // namespace pyengine
