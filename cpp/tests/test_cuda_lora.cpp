// The CUDA batched LoRA kernel (cuda/lora_kernels.cuh) run on the host through
// cuda_host_emulation.h, against a float64 reference on random inputs: rows of several
// slots, rows without one and a slot past the slots (both left bit for bit), one part and
// stacked parts of uneven columns, float32, float16 and bfloat16.
#include "cuda_host_emulation.h"
// The kernel after the emulation.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/lora_kernels.cuh"
#include "harness.h"
#include "normal_values.h"

namespace {

using pyengine::cuda::from_float;
using pyengine::cuda::to_float;
using pyengine::emulation::launch;
namespace lk = pyengine::cuda::lora_kernels;

std::mt19937& rng() {
  static std::mt19937 generator(20261203);
  return generator;
}

template <typename T>
std::vector<T> random_values(size_t n, float scale) {
  return pyengine::testing::normal_values<T>(rng(), n, scale);
}

template <typename T>
void lora_case(int k, const std::vector<int>& columns, int rank, int num_slots,
               const std::vector<int32_t>& slots, double tolerance, const char* what) {
  const int parts = static_cast<int>(columns.size());
  int n = 0;
  std::vector<int64_t> starts{0};
  for (const int c : columns) starts.push_back(n += c);
  const int tokens = static_cast<int>(slots.size()), ranks = parts * rank;
  std::vector<T> x = random_values<T>(static_cast<size_t>(tokens) * k, 1.0f);
  std::vector<T> out = random_values<T>(static_cast<size_t>(tokens) * n, 1.0f);
  std::vector<T> a = random_values<T>(static_cast<size_t>(num_slots) * ranks * k, 0.2f);
  std::vector<T> b = random_values<T>(static_cast<size_t>(num_slots) * ranks * n, 1.0f);
  std::vector<float> scale(static_cast<size_t>(num_slots));
  for (float& s : scale) s = 0.5f + std::uniform_real_distribution<float>()(rng());
  const std::vector<T> before = out;

  lk::LoRAParams p{};
  p.out = out.data();
  p.x = x.data();
  p.a = a.data();
  p.b = b.data();
  p.slots = slots.data();
  p.scale = scale.data();
  for (int i = 0; i <= parts; ++i) p.part_columns[i] = starts[static_cast<size_t>(i)];
  p.out_stride = n;
  p.x_stride = k;
  p.n = n;
  p.k = k;
  p.ranks = ranks;
  p.num_parts = parts;
  p.num_slots = num_slots;
  launch(dim3(tokens), lk::kThreads, [&] { lk::lora_add_kernel<T>(p); });

  double worst = 0.0, largest = 0.0;
  for (int t = 0; t < tokens; ++t) {
    const int s = slots[static_cast<size_t>(t)];
    for (int c = 0; c < n; ++c) {
      const size_t at = static_cast<size_t>(t) * n + c;
      if (s < 0 || s >= num_slots) {
        CHECK(std::memcmp(&out[at], &before[at], sizeof(T)) == 0);
        continue;
      }
      int part = 0;
      while (c >= starts[static_cast<size_t>(part) + 1]) ++part;
      double delta = 0.0;
      for (int r = part * rank; r < (part + 1) * rank; ++r) {
        double shrunk = 0.0;
        for (int i = 0; i < k; ++i) {
          shrunk += static_cast<double>(to_float(x[static_cast<size_t>(t) * k + i])) *
                    to_float(a[(static_cast<size_t>(s) * ranks + r) * k + i]);
        }
        delta += shrunk * to_float(b[(static_cast<size_t>(s) * ranks + r) * n + c]);
      }
      const double want = to_float(before[at]) + scale[static_cast<size_t>(s)] * delta;
      largest = std::max(largest, std::abs(want));
      const double got = to_float(out[at]);
      worst = std::max(worst, std::isfinite(got) ? std::abs(got - want) : INFINITY);
    }
  }
  if (!(worst / largest < tolerance)) {
    pyengine::testing::fail(
        __FILE__, __LINE__,
        std::string(what) + ": relative error " + std::to_string(worst / largest));
  }
}

}  // namespace

TEST(one_part_float32) { lora_case<float>(96, {64}, 8, 2, {0, -1, 1, 1, 0}, 1e-5, "float32"); }

TEST(stacked_parts_of_uneven_columns_half) {
  lora_case<__half>(200, {96, 32, 32}, 16, 3, {2, 0, -1, 2, 1, 7}, 5e-3, "q/k/v, half");
}

TEST(gate_up_bfloat16_with_slots_past_the_slots) {
  lora_case<__nv_bfloat16>(64, {300, 300}, 4, 2, {1, 5, -1, 0}, 2e-2, "gate/up, bfloat16");
}

int main() { return pyengine::testing::run_all(); }
