// The CUDA mixture-of-experts kernels (cuda/moe_kernels.cuh) run on the host through
// cuda_host_emulation.h, against float64 references on random inputs: the softmax top-k
// (ids exactly, weights to float32's rounding, ties to the lower id), the aligned blocks
// (every slot of the rank's experts once, in blocks of one expert, slots ascending), and
// the whole layer (gate/up, down, combine) in float16 and bfloat16, for a decode row,
// rows that leave experts without a token, a token routed twice to one expert, a rank's
// share of the experts (expert parallelism) and weights applied to the input (Llama 4).
#include "cuda_host_emulation.h"
// The kernels after the emulation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/moe_kernels.cuh"
#include "harness.h"
#include "normal_values.h"

namespace {

using pyengine::cuda::from_float;
using pyengine::cuda::to_float;
using pyengine::emulation::launch;
namespace mk = pyengine::cuda::moe_kernels;

std::mt19937& rng() {
  static std::mt19937 generator(20261206);
  return generator;
}

template <typename T>
std::vector<T> random_values(size_t n, float scale) {
  return pyengine::testing::normal_values<T>(rng(), n, scale);
}

void check_relative(double worst, double largest, double tolerance, const std::string& what) {
  if (!(worst / largest < tolerance)) {
    pyengine::testing::fail(__FILE__, __LINE__,
                            what + ": relative error " + std::to_string(worst / largest));
  }
}

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

template <typename T>
Routed softmax_topk(const std::vector<T>& logits, int rows, int experts, int top_k,
                    bool renormalize) {
  Routed r{std::vector<int32_t>(static_cast<size_t>(rows) * top_k, -7),
           std::vector<float>(static_cast<size_t>(rows) * top_k, NAN)};
  const dim3 grid((rows + mk::kTopkWarps - 1) / mk::kTopkWarps);
  launch(grid, mk::kTopkWarps * 32, [&] {
    mk::softmax_topk_kernel<T>(r.ids.data(), r.weights.data(), logits.data(), experts, rows,
                               experts, top_k, renormalize);
  });
  return r;
}

template <typename T>
void topk_case(int rows, int experts, int top_k, bool renormalize, const char* what) {
  std::vector<T> logits = random_values<T>(static_cast<size_t>(rows) * experts, 2.0f);
  if (experts > 3) logits[1] = logits[3];  // (a tie: the lower id first)
  const Routed got = softmax_topk(logits, rows, experts, top_k, renormalize);
  for (int r = 0; r < rows; ++r) {
    std::vector<int> order(static_cast<size_t>(experts));
    std::iota(order.begin(), order.end(), 0);
    const auto logit = [&](int e) {
      return to_float(logits[static_cast<size_t>(r) * experts + e]);
    };
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logit(a) > logit(b); });
    double total = 0.0, chosen = 0.0;
    for (int e = 0; e < experts; ++e) total += std::exp(static_cast<double>(logit(e)));
    for (int s = 0; s < top_k; ++s) {
      chosen += std::exp(static_cast<double>(logit(order[s]))) / total;
    }
    for (int s = 0; s < top_k; ++s) {
      const size_t at = static_cast<size_t>(r) * top_k + s;
      CHECK(got.ids[at] == order[static_cast<size_t>(s)]);
      double want = std::exp(static_cast<double>(logit(order[s]))) / total;
      if (renormalize) want /= chosen;
      check_relative(std::abs(got.weights[at] - want), want, 1e-5, what);
    }
  }
}

struct Aligned {
  std::vector<int32_t> sorted, block_experts;
};

Aligned align(const std::vector<int32_t>& ids, int first, int experts) {
  const int slots = static_cast<int>(ids.size());
  const int max_blocks = std::min(slots, (slots + mk::kBlockRows - 1) / mk::kBlockRows + experts);
  Aligned a{std::vector<int32_t>(static_cast<size_t>(max_blocks) * mk::kBlockRows, -9),
            std::vector<int32_t>(static_cast<size_t>(max_blocks), -9)};
  launch(dim3(1), mk::kAlignThreads, [&] {
    mk::align_kernel(a.sorted.data(), a.block_experts.data(), ids.data(), slots, first, experts,
                     max_blocks);
  });
  // Every slot of the rank's experts once, in a block of its expert, ascending within it.
  std::vector<int> seen(ids.size(), 0);
  int last_expert = -1, last_slot = -1;
  bool ended = false;
  for (size_t b = 0; b < a.block_experts.size(); ++b) {
    const int e = a.block_experts[b];
    if (e < 0) {
      ended = true;
      continue;
    }
    CHECK(!ended && e < experts && e >= last_expert);
    if (e != last_expert) last_slot = -1;
    last_expert = e;
    for (int i = 0; i < mk::kBlockRows; ++i) {
      const int s = a.sorted[b * mk::kBlockRows + static_cast<size_t>(i)];
      if (s < 0) continue;
      CHECK(ids[static_cast<size_t>(s)] == first + e && s > last_slot);
      last_slot = s;
      ++seen[static_cast<size_t>(s)];
    }
  }
  for (size_t s = 0; s < ids.size(); ++s) {
    const bool local = ids[s] >= first && ids[s] < first + experts;
    CHECK(seen[s] == (local ? 1 : 0));
  }
  return a;
}

// The layer through the three product kernels, checked against float64 over the same
// 16-bit inputs.
template <typename T>
void layer_case(int rows, int hidden, int n, int experts, int top_k, const Routed& routed,
                int first, int local, bool on_input, double tolerance, const char* what) {
  const int slots = rows * top_k;
  const std::vector<T> x = random_values<T>(static_cast<size_t>(rows) * hidden, 1.0f);
  const std::vector<T> gate_up =
      random_values<T>(static_cast<size_t>(local) * 2 * n * hidden, 1.0f / std::sqrt(hidden));
  const std::vector<T> down =
      random_values<T>(static_cast<size_t>(local) * hidden * n, 1.0f / std::sqrt(n));
  const Aligned a = align(routed.ids, first, local);
  const auto blocks = static_cast<unsigned>(a.block_experts.size());

  // One product over the aligned blocks: out [slots, columns] of x [.., k] and w.
  const auto gemm = [&](auto is_gate_up, void* out, const void* in, const void* w, int columns,
                        int k) {
    mk::ExpertGemmParams p{};
    p.sorted = a.sorted.data();
    p.block_experts = a.block_experts.data();
    p.weights = routed.weights.data();
    p.top_k = top_k;
    p.on_input = on_input;
    p.out = out;
    p.out_stride = columns;
    p.x = in;
    p.x_stride = k;
    p.w = w;
    p.n = columns;
    p.k = k;
    const auto tiles = static_cast<unsigned>((columns + mk::kWarps * mk::kTileColumns - 1) /
                                             (mk::kWarps * mk::kTileColumns));
    launch(dim3(tiles, blocks), mk::kWarps * 32,
           [&] { mk::expert_gemm_kernel<T, decltype(is_gate_up)::value>(p); });
  };
  std::vector<T> h(static_cast<size_t>(slots) * n, from_float<T>(NAN));
  gemm(std::true_type{}, h.data(), x.data(), gate_up.data(), n, hidden);
  std::vector<float> y(static_cast<size_t>(slots) * hidden, NAN);
  gemm(std::false_type{}, y.data(), h.data(), down.data(), hidden, n);
  std::vector<T> out(static_cast<size_t>(rows) * hidden, from_float<T>(NAN));
  launch(dim3(static_cast<unsigned>(rows)), mk::kCombineThreads, [&] {
    mk::combine_kernel<T>(out.data(), hidden, y.data(), hidden, routed.ids.data(), top_k, first,
                          local, hidden);
  });

  double worst = 0.0, largest = 0.0;
  for (int r = 0; r < rows; ++r) {
    std::vector<double> want(static_cast<size_t>(hidden), 0.0);
    for (int s = 0; s < top_k; ++s) {
      const int e = routed.ids[static_cast<size_t>(r) * top_k + s] - first;
      if (e < 0 || e >= local) continue;
      const double weight = routed.weights[static_cast<size_t>(r) * top_k + s];
      std::vector<double> act(static_cast<size_t>(n));
      for (int j = 0; j < n; ++j) {
        double g = 0.0, u = 0.0;
        for (int i = 0; i < hidden; ++i) {
          const double xi =
              to_float(x[static_cast<size_t>(r) * hidden + i]) * (on_input ? weight : 1.0);
          g += xi * to_float(gate_up[(static_cast<size_t>(e) * 2 * n + j) * hidden + i]);
          u += xi * to_float(gate_up[(static_cast<size_t>(e) * 2 * n + n + j) * hidden + i]);
        }
        act[static_cast<size_t>(j)] = g / (1.0 + std::exp(-g)) * u;
      }
      for (int c = 0; c < hidden; ++c) {
        double sum = 0.0;
        for (int j = 0; j < n; ++j) {
          sum += act[static_cast<size_t>(j)] *
                 to_float(down[(static_cast<size_t>(e) * hidden + c) * n + j]);
        }
        want[static_cast<size_t>(c)] += on_input ? sum : sum * weight;
      }
    }
    for (int c = 0; c < hidden; ++c) {
      const double w = want[static_cast<size_t>(c)];
      const double got = to_float(out[static_cast<size_t>(r) * hidden + c]);
      largest = std::max(largest, std::abs(w));
      worst = std::max(worst, std::isfinite(got) ? std::abs(got - w) : INFINITY);
    }
  }
  check_relative(worst, largest, tolerance, what);
}

}  // namespace

TEST(softmax_topk_float32_renormalised) { topk_case<float>(9, 8, 2, true, "float32, top 2"); }

TEST(softmax_topk_bfloat16_many_experts) {
  topk_case<__nv_bfloat16>(5, 128, 8, false, "bfloat16, 128 experts, top 8");
}

TEST(softmax_topk_half_odd_experts) { topk_case<__half>(3, 60, 4, true, "half, 60 experts"); }

TEST(aligned_blocks_of_a_ranks_experts_with_repeats) {
  // (token 1 routed twice to expert 3; experts 0 and 5 chosen by none; expert 4 of 16
  // slots' worth: exactly a block)
  std::vector<int32_t> ids{3, 1, 3, 3, 2, 6};
  for (int i = 0; i < 16; ++i) ids.push_back(4);
  align(ids, 0, 8);
  align(ids, 2, 3);  // (a rank's experts 2, 3 and 4)
}

TEST(a_decode_row_in_bfloat16) {
  const int experts = 16, top_k = 4;
  const auto logits = random_values<float>(experts, 1.0f);
  const Routed routed = softmax_topk(logits, 1, experts, top_k, true);
  layer_case<__nv_bfloat16>(1, 64, 48, experts, top_k, routed, 0, experts, false, 8e-3,
                            "decode, bfloat16");
}

TEST(rows_that_leave_experts_idle_in_half) {
  const int rows = 37, experts = 8, top_k = 2;
  const auto logits = random_values<float>(static_cast<size_t>(rows) * experts, 1.0f);
  const Routed routed = softmax_topk(logits, rows, experts, top_k, false);
  layer_case<__half>(rows, 96, 80, experts, top_k, routed, 0, experts, false, 5e-3,
                     "37 rows, half");
}

TEST(a_token_routed_twice_and_a_ranks_share_of_the_experts) {
  Routed routed{{3, 3, 1, 5, 0, 2, 4, 3}, {0.25f, 0.5f, 0.75f, 1.0f, 0.5f, 0.5f, 0.3f, 0.7f}};
  layer_case<__half>(4, 32, 16, 6, 2, routed, 0, 6, false, 5e-3, "repeats, half");
  layer_case<__half>(4, 32, 16, 6, 2, routed, 2, 3, false, 5e-3, "experts 2-4 of 6, half");
}

TEST(weights_on_the_input_in_bfloat16) {
  Routed routed{{2, 0, 1, 3, 2}, {0.9f, 0.4f, 0.7f, 0.2f, 0.6f}};
  layer_case<__nv_bfloat16>(5, 48, 32, 4, 1, routed, 0, 4, true, 8e-3, "on input, bfloat16");
}

int main() { return pyengine::testing::run_all(); }
