// Mixture-of-experts layers on the CPU (see pyengine/moe.h): the routing, then each
// active expert's rows gathered and multiplied by dense's panel kernels, its sums added
// to their rows.
#include "pyengine/moe.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "float_convert.h"
#include "moe_cuda.h"
#include "pyengine/dense.h"
#include "pyengine/errors.h"
#include "tensor_checks.h"

namespace pyengine {
namespace {

using detail::arg;
using detail::check_rows;

// A [rows, top_k] routing tensor of `dtype` with dense rows (top_k < 0: any).
void check_routing(const TensorView& t, const char* op, const char* name, DType dtype,
                   int64_t rows, int64_t top_k) {
  check_rows(t, op, name, 2, dtype);
  if (t.shape[0] != rows || (top_k >= 0 && t.shape[1] != top_k)) {
    throw InvalidArgument(arg(op, name) + " must be [" + std::to_string(rows) + ", " +
                          (top_k >= 0 ? std::to_string(top_k) : std::string("top_k")) +
                          "] (a row per token), got " + t.describe());
  }
}

// Row e of a stack of packed weights [experts, size], as the 1-d packed weight dense takes.
TensorView expert_weight(const TensorView& stacked, int64_t e) {
  TensorView v = stacked;
  v.ndim = 1;
  v.shape[0] = stacked.shape[1];
  v.strides[0] = stacked.strides[1];
  v.data = static_cast<char*>(stacked.data) +
           e * stacked.strides[0] * static_cast<int64_t>(stacked.element_size());
  return v;
}

void check_stack(const TensorView& t, const char* op, const char* name, int64_t experts) {
  detail::check_cpu(t, op, name);
  if (t.ndim != 2 || t.shape[0] != experts || (t.strides[1] != 1 && t.shape[1] > 1)) {
    throw InvalidArgument(arg(op, name) + " must be [" + std::to_string(experts) +
                          ", size]: a packed weight per expert, each dense, got " + t.describe());
  }
}

// A dense [rows, columns] view of a scratch buffer.
TensorView scratch_view(void* data, DType dtype, int64_t rows, int64_t columns) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.ndim = 2;
  v.shape[0] = rows;
  v.shape[1] = columns;
  v.strides[0] = columns;
  v.strides[1] = 1;
  return v;
}

// The routed (row, slot) pairs of this rank's experts [first, first + local) grouped by
// expert, rows ascending within one: entries[starts[e], starts[e + 1]) are expert
// first + e's.
struct ExpertGroups {
  std::vector<int64_t> starts;
  std::vector<int64_t> rows;
  std::vector<int64_t> slots;
  int64_t most_rows = 0;  // the most any expert has
};

void group_by_expert(ExpertGroups& g, const TensorView& ids, int64_t total, int64_t first,
                     int64_t local, const char* op) {
  const int64_t t = ids.shape[0], top_k = ids.shape[1];
  const auto* id = static_cast<const int32_t*>(ids.data);
  const auto local_index = [first, local](int32_t e) {
    return e >= first && e < first + local ? e - first : -1;
  };
  g.starts.assign(static_cast<size_t>(local + 1), 0);
  for (int64_t r = 0; r < t; ++r) {
    for (int64_t s = 0; s < top_k; ++s) {
      const int32_t e = id[r * ids.strides[0] + s];
      if (e < 0 || e >= total) {
        throw InvalidArgument(std::string(op) + ": ids[" + std::to_string(r) + ", " +
                              std::to_string(s) + "] is " + std::to_string(e) +
                              ", outside [0, " + std::to_string(total) + ")");
      }
      if (const int64_t i = local_index(e); i >= 0) ++g.starts[static_cast<size_t>(i) + 1];
    }
  }
  g.most_rows = *std::max_element(g.starts.begin(), g.starts.end());
  std::partial_sum(g.starts.begin(), g.starts.end(), g.starts.begin());
  g.rows.resize(static_cast<size_t>(g.starts.back()));
  g.slots.resize(g.rows.size());
  std::vector<int64_t> next(g.starts.begin(), g.starts.end() - 1);
  for (int64_t r = 0; r < t; ++r) {
    for (int64_t s = 0; s < top_k; ++s) {
      const int64_t i = local_index(id[r * ids.strides[0] + s]);
      if (i < 0) continue;
      const auto at = static_cast<size_t>(next[static_cast<size_t>(i)]++);
      g.rows[at] = r;
      g.slots[at] = s;
    }
  }
}

// Row e of a float32 [experts, columns] bias, as dense takes one (an empty view: none).
TensorView bias_row(const TensorView& bias, int64_t e) {
  if (bias.data == nullptr) return TensorView{};
  TensorView v = bias;
  v.ndim = 1;
  v.shape[0] = bias.shape[1];
  v.strides[0] = 1;
  v.data = static_cast<float*>(bias.data) + e * bias.strides[0];
  return v;
}

// hidden [m, n] = the activation of product [m, 2n] ([gate | up] a row) plus `bias`
// (float32 [2n], or none), in x's dtype.
void activate(const void* product, const TensorView& bias, void* hidden, bool bf16, int64_t m,
              int64_t n, const ExpertActivation& a) {
  const auto* b = static_cast<const float*>(bias.data);
  for (int64_t i = 0; i < m * n; ++i) {
    const int64_t row = i / n, j = i % n;
    const int64_t gate_at = row * 2 * n + j, up_at = gate_at + n;
    float gate = 0.0f, up = 0.0f;
    if (bf16) {
      gate = detail::bf16_to_float(static_cast<const uint16_t*>(product)[gate_at]);
      up = detail::bf16_to_float(static_cast<const uint16_t*>(product)[up_at]);
    } else {
      gate = static_cast<const float*>(product)[gate_at];
      up = static_cast<const float*>(product)[up_at];
    }
    if (b != nullptr) {
      gate += b[j];
      up += b[n + j];
    }
    float value = 0.0f;
    if (a.clamped_swiglu) {
      const float g = std::min(gate, a.limit), u = std::clamp(up, -a.limit, a.limit);
      value = g / (1.0f + std::exp(-a.alpha * g)) * (u + 1.0f);
    } else {
      value = gate / (1.0f + std::exp(-gate)) * up;
    }
    if (bf16) {
      static_cast<uint16_t*>(hidden)[i] = detail::float_to_bf16(value);
    } else {
      static_cast<float*>(hidden)[i] = value;
    }
  }
}

// Reused between calls (a decode step's layers call it with the same few rows).
struct Scratch {
  ExpertGroups groups;
  std::vector<float> hidden, sums, acc, entry_sums;
  std::vector<uint16_t> hidden16, sums16;
};

// Up to this many rows an expert (a decode step's), the threads take whole experts
// rather than share each expert's panels.
constexpr int64_t kExpertsAtOnceRows = 8;

bool in_parallel() {
#ifdef _OPENMP
  return omp_in_parallel() != 0;
#else
  return true;  // (no threads to share the experts among)
#endif
}

template <class T>
T* sized(std::vector<T>& v, int64_t size) {
  if (static_cast<int64_t>(v.size()) < size) v.resize(static_cast<size_t>(size));
  return v.data();
}

// acc [t, hidden] (float32 sums, ld_acc apart) += each row's shared expert output, times
// sigmoid(x[r] . gate) where the expert has a gate.
void add_shared_expert(float* acc, int64_t ld_acc, const TensorView& x, const SharedExpert& shared,
                       bool int8_activations, Scratch& s) {
  constexpr const char* op = "fused_experts";
  const int64_t t = x.shape[0], h = x.shape[1], n = shared.n;
  const bool bf16 = x.dtype == DType::kBFloat16;
  if (n < 1) {
    throw InvalidArgument(arg(op, "shared_n") + " must be positive, got " + std::to_string(n));
  }
  if (shared.down.data == nullptr) throw InvalidArgument(arg(op, "shared_down") + " is missing");
  const bool gated = shared.gate.data != nullptr;
  if (gated) detail::check_vector(shared.gate, op, "shared_gate", h);
  void* hidden = bf16 ? static_cast<void*>(sized(s.hidden16, t * n)) : sized(s.hidden, t * n);
  void* sums = bf16 ? static_cast<void*>(sized(s.sums16, t * h)) : sized(s.sums, t * h);
  const TensorView hidden_view = scratch_view(hidden, x.dtype, t, n);
  const TensorView sums_view = scratch_view(sums, x.dtype, t, h);
  dense_silu_and_mul(hidden_view, x, shared.gate_up, n, int8_activations);
  dense(sums_view, hidden_view, shared.down, TensorView{}, h, int8_activations);
  // (element j of row r of a float32 or bfloat16 buffer, as float32)
  const auto value = [bf16](const void* data, int64_t at) {
    return bf16 ? detail::bf16_to_float(static_cast<const uint16_t*>(data)[at])
                : static_cast<const float*>(data)[at];
  };
  const auto* g = static_cast<const float*>(shared.gate.data);
  for (int64_t r = 0; r < t; ++r) {
    float scale = 1.0f;
    if (gated) {
      float dot = 0.0f;
      for (int64_t j = 0; j < h; ++j) dot += value(x.data, r * x.strides[0] + j) * g[j];
      scale = 1.0f / (1.0f + std::exp(-dot));
    }
    float* dst = acc + r * ld_acc;
    for (int64_t j = 0; j < h; ++j) {
      const float y = value(sums, r * h + j);
      dst[j] += gated ? scale * y : y;
    }
  }
}

}  // namespace

namespace {

// The routing kernels' common part: checks ids and weights [t, top_k] against logits
// [t, experts] (float32 or bfloat16), then calls route(l, id, w) for each row, l its
// logits as float32, id and w its outputs.
template <class Route>
void route_rows(const TensorView& ids, const TensorView& weights, const TensorView& logits,
                const char* op, const Route& route) {
  const bool bf16 = logits.ndim == 2 && logits.dtype == DType::kBFloat16;
  check_rows(logits, op, "logits", 2, bf16 ? DType::kBFloat16 : DType::kFloat32);
  const int64_t t = logits.shape[0], experts = logits.shape[1];
  check_routing(ids, op, "ids", DType::kInt32, t, -1);
  const int64_t top_k = ids.shape[1];
  check_routing(weights, op, "weights", DType::kFloat32, t, top_k);
  detail::check_writable(ids, op, "ids");
  detail::check_writable(weights, op, "weights");
  if (top_k < 1 || top_k > experts) {
    throw InvalidArgument(std::string(op) + ": top_k (ids' columns) must be in [1, " +
                          std::to_string(experts) + "], got " + std::to_string(top_k));
  }
  std::vector<float> widened(bf16 ? static_cast<size_t>(experts) : 0);
  for (int64_t r = 0; r < t; ++r) {
    const float* l = static_cast<const float*>(logits.data) + r * logits.strides[0];
    if (bf16) {  // (routed in float32, as the routers compute it)
      const auto* row = static_cast<const uint16_t*>(logits.data) + r * logits.strides[0];
      std::transform(row, row + experts, widened.begin(), detail::bf16_to_float);
      l = widened.data();
    }
    route(l, static_cast<int32_t*>(ids.data) + r * ids.strides[0],
          static_cast<float*>(weights.data) + r * weights.strides[0]);
  }
}

// order[0, k) = the k highest of values[0, n) (as indices), highest first, the lower index
// first among equals; order holds n entries.
void top_indices(std::vector<int32_t>& order, const float* values, int64_t n, int64_t k) {
  order.resize(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [values](int32_t a, int32_t b) {
    return values[a] > values[b] || (values[a] == values[b] && a < b);
  });
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

}  // namespace

void moe_softmax_topk(const TensorView& ids, const TensorView& weights, const TensorView& logits,
                      bool renormalize, void* stream) {
  constexpr const char* op = "moe_softmax_topk";
  if (detail::on_cuda(logits.device, op)) {
    return detail::moe_softmax_topk_cuda(ids, weights, logits, renormalize, stream);
  }
  const int64_t experts = logits.ndim == 2 ? logits.shape[1] : 0;
  const int64_t top_k = ids.ndim == 2 ? ids.shape[1] : 0;
  std::vector<int32_t> order;
  route_rows(ids, weights, logits, op, [&](const float* l, int32_t* id, float* w) {
    // The top_k by logit are the top_k by probability (softmax keeps the order), chosen
    // before any rounding of the exponentials could tie two.
    top_indices(order, l, experts, top_k);
    const float max = l[order[0]];
    float total = 0.0f;
    for (int64_t e = 0; e < experts; ++e) total += std::exp(l[e] - max);
    float chosen = 0.0f;
    for (int64_t s = 0; s < top_k; ++s) {
      id[s] = order[static_cast<size_t>(s)];
      w[s] = std::exp(l[id[s]] - max) / total;
      chosen += w[s];
    }
    if (renormalize) {
      for (int64_t s = 0; s < top_k; ++s) w[s] /= chosen;
    }
  });
}

void moe_grouped_topk(const TensorView& ids, const TensorView& weights, const TensorView& logits,
                      const TensorView& bias, int64_t num_groups, int64_t topk_groups,
                      bool renormalize, double scaling_factor) {
  constexpr const char* op = "moe_grouped_topk";
  const int64_t experts = logits.ndim == 2 ? logits.shape[1] : 0;
  const int64_t top_k = ids.ndim == 2 ? ids.shape[1] : 0;
  if (num_groups < 1 || experts % num_groups != 0 || topk_groups < 1 ||
      topk_groups > num_groups || topk_groups * (experts / num_groups) < top_k) {
    throw InvalidArgument(std::string(op) + ": " + std::to_string(experts) + " experts in " +
                          std::to_string(num_groups) + " groups, " + std::to_string(topk_groups) +
                          " of them, cannot hold top_k " + std::to_string(top_k));
  }
  const bool biased = bias.data != nullptr;
  if (biased) detail::check_vector(bias, op, "bias", experts);
  const int64_t per_group = experts / num_groups;
  const auto* b = static_cast<const float*>(bias.data);
  std::vector<float> scores(static_cast<size_t>(experts)), choice(scores.size());
  std::vector<float> group_scores(static_cast<size_t>(num_groups));
  std::vector<int32_t> order, groups;
  route_rows(ids, weights, logits, op, [&](const float* l, int32_t* id, float* w) {
    for (int64_t e = 0; e < experts; ++e) {
      scores[static_cast<size_t>(e)] = sigmoid(l[e]);
      choice[static_cast<size_t>(e)] = biased ? scores[static_cast<size_t>(e)] + b[e]
                                              : scores[static_cast<size_t>(e)];
    }
    // Each group by the sum of its two best (one, in groups of one), then the best groups.
    for (int64_t g = 0; g < num_groups; ++g) {
      top_indices(order, choice.data() + g * per_group, per_group, std::min<int64_t>(2, per_group));
      float sum = 0.0f;
      for (int64_t i = 0; i < std::min<int64_t>(2, per_group); ++i) {
        sum += choice[static_cast<size_t>(g * per_group + order[static_cast<size_t>(i)])];
      }
      group_scores[static_cast<size_t>(g)] = sum;
    }
    top_indices(groups, group_scores.data(), num_groups, topk_groups);
    std::vector<float>& masked = choice;  // (the other groups' experts out of the running)
    std::vector<bool> allowed(static_cast<size_t>(num_groups), false);
    for (int64_t i = 0; i < topk_groups; ++i) allowed[static_cast<size_t>(groups[i])] = true;
    for (int64_t e = 0; e < experts; ++e) {
      if (!allowed[static_cast<size_t>(e / per_group)]) {
        masked[static_cast<size_t>(e)] = -std::numeric_limits<float>::infinity();
      }
    }
    top_indices(order, masked.data(), experts, top_k);
    float chosen = 0.0f;
    for (int64_t s = 0; s < top_k; ++s) {
      id[s] = order[static_cast<size_t>(s)];
      w[s] = scores[static_cast<size_t>(id[s])];
      chosen += w[s];
    }
    const float scale = static_cast<float>(scaling_factor);
    for (int64_t s = 0; s < top_k; ++s) {
      w[s] = (renormalize ? w[s] / (chosen + 1e-20f) : w[s]) * scale;
    }
  });
}

void moe_sigmoid_topk(const TensorView& ids, const TensorView& weights, const TensorView& logits) {
  constexpr const char* op = "moe_sigmoid_topk";
  const int64_t experts = logits.ndim == 2 ? logits.shape[1] : 0;
  const int64_t top_k = ids.ndim == 2 ? ids.shape[1] : 0;
  std::vector<int32_t> order;
  route_rows(ids, weights, logits, op, [&](const float* l, int32_t* id, float* w) {
    top_indices(order, l, experts, top_k);
    for (int64_t s = 0; s < top_k; ++s) {
      id[s] = order[static_cast<size_t>(s)];
      w[s] = sigmoid(l[id[s]]);
    }
  });
}

void fused_experts(const TensorView& out, const TensorView& x, const TensorView& ids,
                   const TensorView& weights, const TensorView& gate_up, const TensorView& down,
                   int64_t n, bool on_input, bool int8_activations, const SharedExpert& shared,
                   int64_t first_expert, int64_t num_experts, const ExpertActivation& activation) {
  constexpr const char* op = "fused_experts";
  const bool bf16 = x.ndim == 2 && x.dtype == DType::kBFloat16;
  const DType dtype = bf16 ? DType::kBFloat16 : DType::kFloat32;
  check_rows(x, op, "x", 2, dtype);
  check_rows(out, op, "out", 2, dtype);
  detail::check_writable(out, op, "out");
  const int64_t t = x.shape[0], h = x.shape[1];
  if (out.shape[0] != t || out.shape[1] != h) {
    throw InvalidArgument(arg(op, "out") + " must be [" + std::to_string(t) + ", " +
                          std::to_string(h) + "] (x's shape), got " + out.describe());
  }
  if (out.data == x.data) throw InvalidArgument(arg(op, "out") + " must not be x");
  check_routing(ids, op, "ids", DType::kInt32, t, -1);
  const int64_t top_k = ids.shape[1];
  check_routing(weights, op, "weights", DType::kFloat32, t, top_k);
  const int64_t experts = gate_up.ndim == 2 ? gate_up.shape[0] : 0;
  check_stack(gate_up, op, "gate_up", experts);
  check_stack(down, op, "down", experts);
  if (n < 1) throw InvalidArgument(arg(op, "n") + " must be positive, got " + std::to_string(n));
  const int64_t total = num_experts == 0 ? experts : num_experts;
  if (first_expert < 0 || first_expert + experts > total) {
    throw InvalidArgument(std::string(op) + ": this rank's experts [" +
                          std::to_string(first_expert) + ", " +
                          std::to_string(first_expert + experts) + ") (first_expert and " +
                          "gate_up's rows) must lie in the layer's [0, " + std::to_string(total) +
                          ") (num_experts)");
  }

  // (gpt-oss's form: a plain gate/up product, biases, the clamped SwiGLU)
  const bool plain = activation.clamped_swiglu || activation.gate_up_bias.data != nullptr;
  for (const auto& [bias, name, columns] :
       {std::tuple{&activation.gate_up_bias, "gate_up_bias", 2 * n},
        std::tuple{&activation.down_bias, "down_bias", h}}) {
    if (bias->data == nullptr) continue;
    detail::check_cpu(*bias, op, name);
    if (bias->ndim != 2 || bias->dtype != DType::kFloat32 || bias->shape[0] != experts ||
        bias->shape[1] != columns || !bias->is_contiguous()) {
      throw InvalidArgument(arg(op, name) + " must be dense float32 [" + std::to_string(experts) +
                            ", " + std::to_string(columns) + "], got " + bias->describe());
    }
  }
  thread_local Scratch s;
  group_by_expert(s.groups, ids, total, first_expert, experts, op);
  const ExpertGroups& g = s.groups;
  const auto* w = static_cast<const float*>(weights.data);
  const int64_t ldw = weights.strides[0];
  // The sums, float32: out itself, or (bfloat16) a float32 copy rounded at the end.
  float* acc = bf16 ? sized(s.acc, t * h) : static_cast<float*>(out.data);
  const int64_t ld_acc = bf16 ? h : out.strides[0];
  for (int64_t r = 0; r < t; ++r) std::fill_n(acc + r * ld_acc, h, 0.0f);

  // Expert e's rows' sums into `sums` (its rows' count of hidden-size rows, x's dtype):
  // its rows gathered (scaled first where the weights scale the input), then its gate/up
  // and down products. Its scratch is the calling thread's.
  const auto expert_sums = [&](int64_t e, void* sums) {
    thread_local std::vector<float> inputs, hidden;
    thread_local std::vector<uint16_t> inputs16, hidden16;
    const int64_t first = g.starts[e], m = g.starts[e + 1] - first;
    void* in = bf16 ? static_cast<void*>(sized(inputs16, m * h)) : sized(inputs, m * h);
    for (int64_t i = 0; i < m; ++i) {
      const int64_t r = g.rows[first + i];
      const float scale = on_input ? w[r * ldw + g.slots[first + i]] : 1.0f;
      if (bf16) {
        const uint16_t* row = static_cast<const uint16_t*>(x.data) + r * x.strides[0];
        uint16_t* dst = static_cast<uint16_t*>(in) + i * h;
        if (!on_input) {
          std::copy_n(row, h, dst);
          continue;
        }
        for (int64_t j = 0; j < h; ++j) {
          dst[j] = detail::float_to_bf16(detail::bf16_to_float(row[j]) * scale);
        }
      } else {
        const float* row = static_cast<const float*>(x.data) + r * x.strides[0];
        float* dst = static_cast<float*>(in) + i * h;
        for (int64_t j = 0; j < h; ++j) dst[j] = on_input ? row[j] * scale : row[j];
      }
    }
    void* mid = bf16 ? static_cast<void*>(sized(hidden16, m * n)) : sized(hidden, m * n);
    const TensorView hidden_rows = scratch_view(mid, dtype, m, n);
    const TensorView in_rows = scratch_view(in, dtype, m, h);
    if (plain) {
      thread_local std::vector<float> product;
      thread_local std::vector<uint16_t> product16;
      void* p = bf16 ? static_cast<void*>(sized(product16, m * 2 * n)) : sized(product, m * 2 * n);
      dense(scratch_view(p, dtype, m, 2 * n), in_rows, expert_weight(gate_up, e), TensorView{},
            2 * n, int8_activations);
      activate(p, bias_row(activation.gate_up_bias, e), mid, bf16, m, n, activation);
    } else {
      dense_silu_and_mul(hidden_rows, in_rows, expert_weight(gate_up, e), n, int8_activations);
    }
    dense(scratch_view(sums, dtype, m, h), hidden_rows, expert_weight(down, e), TensorView{}, h,
          int8_activations);
  };
  // Expert e's rows' sums (`sums`, its rows', plus its down bias where it has one) added
  // to their rows, times their weights.
  const auto add_expert = [&](int64_t e, const void* sums) {
    const int64_t first = g.starts[e], m = g.starts[e + 1] - first;
    const TensorView bias = bias_row(activation.down_bias, e);
    const auto* b = static_cast<const float*>(bias.data);
    for (int64_t i = 0; i < m; ++i) {
      float* dst = acc + g.rows[first + i] * ld_acc;
      const float scale = on_input ? 1.0f : w[g.rows[first + i] * ldw + g.slots[first + i]];
      for (int64_t j = 0; j < h; ++j) {
        const float y = bf16 ? detail::bf16_to_float(static_cast<const uint16_t*>(sums)[i * h + j])
                             : static_cast<const float*>(sums)[i * h + j];
        dst[j] += (b != nullptr ? y + b[j] : y) * scale;
      }
    }
  };
  std::vector<int64_t> active;
  for (int64_t e = 0; e < experts; ++e) {
    if (g.starts[e + 1] > g.starts[e]) active.push_back(e);
  }
  const size_t element = bf16 ? sizeof(uint16_t) : sizeof(float);
  if (g.most_rows <= kExpertsAtOnceRows && active.size() > 1 && !in_parallel()) {
    // A decode step's few rows an expert: the threads take whole experts (each product
    // on one thread, streaming its weights with no barrier between experts), every
    // entry's sums kept, then added in expert order as below.
    const auto floats = static_cast<int64_t>(
        (g.rows.size() * static_cast<size_t>(h) * element + sizeof(float) - 1) / sizeof(float));
    auto* ys = reinterpret_cast<unsigned char*>(sized(s.entry_sums, floats));
    // (an exception must not leave the parallel region: the first is thrown after it)
    std::exception_ptr failed;
#pragma omp parallel for schedule(dynamic, 1)
    for (size_t a = 0; a < active.size(); ++a) {
      try {
        expert_sums(active[a], ys + static_cast<size_t>(g.starts[active[a]] * h) * element);
      } catch (...) {
#pragma omp critical(fused_experts_failure)
        if (!failed) failed = std::current_exception();
      }
    }
    if (failed) std::rethrow_exception(failed);
    for (const int64_t e : active) {
      add_expert(e, ys + static_cast<size_t>(g.starts[e] * h) * element);
    }
  } else {
    void* sums = bf16 ? static_cast<void*>(sized(s.sums16, g.most_rows * h))
                      : sized(s.sums, g.most_rows * h);
    for (const int64_t e : active) {
      expert_sums(e, sums);
      add_expert(e, sums);
    }
  }
  if (shared.gate_up.data != nullptr) {
    add_shared_expert(acc, ld_acc, x, shared, int8_activations, s);
  }
  if (bf16) {
    for (int64_t r = 0; r < t; ++r) {
      auto* dst = static_cast<uint16_t*>(out.data) + r * out.strides[0];
      for (int64_t j = 0; j < h; ++j) dst[j] = detail::float_to_bf16(acc[r * h + j]);
    }
  }
}

}  // namespace pyengine
