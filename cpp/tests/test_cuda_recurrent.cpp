// The CUDA recurrent-state kernels (cuda/recurrent_kernels.cuh) run on the host through
// cuda_host_emulation.h, against float64 recurrences token by token: mixed requests (new
// ones and ones continuing from their slots, one token or several, none; runs of whole
// chunks of 16 and of chunks and a part), unused slots left as they were, grouped heads
// and a clamp of the step.
#include "cuda_host_emulation.h"
// The kernels after the emulation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cuda/recurrent_kernels.cuh"
#include "harness.h"

namespace {

using pyengine::emulation::launch;
namespace k = pyengine::cuda::recurrent;

std::mt19937& rng() {
  static std::mt19937 generator(20261207);
  return generator;
}

std::vector<float> random(size_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng());
  return v;
}

// The step's requests: lengths, slots (a permutation's first ones) and which are new.
struct Step {
  std::vector<int32_t> starts{0}, slots, has_state;
  int num_slots = 0;
  Step(const std::vector<int>& lengths, int slot_count) : num_slots(slot_count) {
    std::vector<int32_t> order(slot_count);
    for (int i = 0; i < slot_count; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng());
    for (size_t r = 0; r < lengths.size(); ++r) {
      starts.push_back(starts.back() + lengths[r]);
      slots.push_back(order[r]);
      has_state.push_back(static_cast<int32_t>(r % 2));
    }
  }
  k::Requests requests() const { return {starts.data(), slots.data(), has_state.data()}; }
  int tokens() const { return starts.back(); }
};

bool close(double got, double want, double tolerance) {
  return std::abs(got - want) <= tolerance * (1.0 + std::abs(want));
}

TEST(gated_delta_rule_matches_the_float64_recurrence) {
  const int hk = 2, hv = 4, dk = 20, dv = 12, per = hv / hk;
  const Step step({1, 4, 0, 37, 32}, 6);
  const int t = step.tokens();
  auto q = random(t * hk * dk), key = random(t * hk * dk), v = random(t * hv * dv);
  auto g = random(t * hv, -1.0f, 0.0f), beta = random(t * hv, 0.0f, 1.0f);
  auto state = random(static_cast<size_t>(step.num_slots) * hv * dk * dv);
  const auto before = state;
  std::vector<float> out(t * hv * dv, NAN);
  const float scale = 0.3f;
  const k::DeltaParams p{out.data(), q.data(), key.data(), v.data(), g.data(), beta.data(),
                         state.data(), step.requests(), hk, hv, dk, dv, scale, true};
  launch(dim3(static_cast<unsigned>(step.slots.size()), hv), k::kThreads,
         [&] { k::delta_rule_kernel(p); });
  std::vector<bool> used(step.num_slots, false);
  for (size_t r = 0; r < step.slots.size(); ++r) {
    const int slot = step.slots[r];
    used[slot] = true;
    for (int h = 0; h < hv; ++h) {
      std::vector<double> s(dk * dv, 0.0);
      const size_t at = (static_cast<size_t>(slot) * hv + h) * dk * dv;
      if (step.has_state[r] != 0) std::copy_n(before.begin() + at, dk * dv, s.begin());
      for (int tok = step.starts[r]; tok < step.starts[r + 1]; ++tok) {
        std::vector<double> qn(dk), kn(dk);
        double qq = 0, kk = 0;
        for (int i = 0; i < dk; ++i) {
          qn[i] = q[(tok * hk + h / per) * dk + i];
          kn[i] = key[(tok * hk + h / per) * dk + i];
          qq += qn[i] * qn[i];
          kk += kn[i] * kn[i];
        }
        for (int i = 0; i < dk; ++i) {
          qn[i] *= scale / std::sqrt(qq + 1e-6);
          kn[i] /= std::sqrt(kk + 1e-6);
        }
        const double decay = std::exp(static_cast<double>(g[tok * hv + h]));
        const double b = beta[tok * hv + h];
        for (int j = 0; j < dv; ++j) {
          double recall = 0;
          for (int i = 0; i < dk; ++i) recall += kn[i] * (s[i * dv + j] *= decay);
          const double d = b * (v[(tok * hv + h) * dv + j] - recall);
          double read = 0;
          for (int i = 0; i < dk; ++i) read += qn[i] * (s[i * dv + j] += kn[i] * d);
          CHECK(close(out[(tok * hv + h) * dv + j], read, 1e-4));
        }
      }
      for (int i = 0; i < dk * dv; ++i) CHECK(close(state[at + i], s[i], 1e-4));
    }
  }
  for (int slot = 0; slot < step.num_slots; ++slot) {
    if (used[slot]) continue;
    const size_t at = static_cast<size_t>(slot) * hv * dk * dv;
    CHECK(std::equal(state.begin() + at, state.begin() + at + hv * dk * dv, before.begin() + at));
  }
}

TEST(causal_conv1d_matches_the_float64_convolution) {
  const int c = 150, width = 4, kept = width - 1;  // (two channel blocks, one partial)
  const Step step({1, 5, 0, 2}, 5);
  const int t = step.tokens();
  auto x = random(t * c), weight = random(c * width), bias = random(c);
  auto state = random(static_cast<size_t>(step.num_slots) * c * kept);
  const auto before = state;
  std::vector<float> out(t * c, NAN);
  const k::ConvParams p{out.data(), x.data(), weight.data(), bias.data(), state.data(),
                        step.requests(), c, width, true};
  launch(dim3(static_cast<unsigned>(step.slots.size()), (c + k::kThreads - 1) / k::kThreads),
         k::kThreads, [&] { k::conv_kernel(p); });
  for (size_t r = 0; r < step.slots.size(); ++r) {
    const int slot = step.slots[r];
    for (int ch = 0; ch < c; ++ch) {
      std::vector<double> seq;
      for (int m = 0; m < kept; ++m) {
        seq.push_back(step.has_state[r] != 0 ? before[(slot * c + ch) * kept + m] : 0.0);
      }
      for (int tok = step.starts[r]; tok < step.starts[r + 1]; ++tok) seq.push_back(x[tok * c + ch]);
      for (int tok = step.starts[r]; tok < step.starts[r + 1]; ++tok) {
        const int at = tok - step.starts[r];
        double acc = bias[ch];
        for (int j = 0; j < width; ++j) acc += weight[ch * width + j] * seq[at + j];
        CHECK(close(out[tok * c + ch], acc / (1.0 + std::exp(-acc)), 1e-5));
      }
      for (int m = 0; m < kept; ++m) {
        CHECK(close(state[(slot * c + ch) * kept + m], seq[seq.size() - kept + m], 0.0));
      }
    }
  }
}

TEST(ssm_scan_matches_the_float64_recurrence) {
  const int heads = 4, groups = 2, head_dim = 6, n = 10, per = heads / groups;
  const Step step({3, 1, 0, 37, 16}, 6);
  const int t = step.tokens();
  auto x = random(t * heads * head_dim), dt = random(t * heads, -2.0f, 2.0f);
  auto a = random(heads, -2.0f, -0.1f), d = random(heads), dt_bias = random(heads);
  auto b = random(t * groups * n), cc = random(t * groups * n);
  auto state = random(static_cast<size_t>(step.num_slots) * heads * head_dim * n);
  const auto before = state;
  std::vector<float> out(t * heads * head_dim, NAN);
  const float dt_min = 0.1f, dt_max = 1.5f;
  const k::SsmParams p{out.data(), x.data(), dt.data(), a.data(), b.data(), cc.data(),
                       d.data(), dt_bias.data(), state.data(), step.requests(), heads,
                       head_dim, groups, n, dt_min, dt_max, true};
  launch(dim3(static_cast<unsigned>(step.slots.size()), heads), k::kThreads,
         [&] { k::ssm_kernel(p); });
  for (size_t r = 0; r < step.slots.size(); ++r) {
    const int slot = step.slots[r];
    for (int h = 0; h < heads; ++h) {
      const size_t at = (static_cast<size_t>(slot) * heads + h) * head_dim * n;
      std::vector<double> s(head_dim * n, 0.0);
      if (step.has_state[r] != 0) std::copy_n(before.begin() + at, head_dim * n, s.begin());
      for (int tok = step.starts[r]; tok < step.starts[r + 1]; ++tok) {
        double stepsize = std::log1p(std::exp(static_cast<double>(dt[tok * heads + h]) + dt_bias[h]));
        stepsize = std::clamp(stepsize, static_cast<double>(dt_min), static_cast<double>(dt_max));
        const int g = h / per;
        for (int row = 0; row < head_dim; ++row) {
          const double xv = x[(tok * heads + h) * head_dim + row];
          double y = 0;
          for (int j = 0; j < n; ++j) {
            double& value = s[row * n + j];
            value = value * std::exp(stepsize * a[h]) + stepsize * xv * b[(tok * groups + g) * n + j];
            y += value * cc[(tok * groups + g) * n + j];
          }
          CHECK(close(out[(tok * heads + h) * head_dim + row], y + d[h] * xv, 1e-4));
        }
      }
      for (int i = 0; i < head_dim * n; ++i) CHECK(close(state[at + i], s[i], 1e-4));
    }
  }
}

}  // namespace

int main() { return pyengine::testing::run_all(); }
