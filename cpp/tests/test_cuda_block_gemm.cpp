// The CUDA block-quantized GEMM (cuda/block_gemm.cuh) run on the host through
// cuda_host_emulation.h, its integers reordered by pack_block_gemm_weight (pyengine_core):
// against a float64 product with the weights dequantized to the 16-bit type, for 4- and
// 8-bit weights, groups of 32 and 16, half and bfloat16, odd m and n, with and without
// a bias; and the reorder's checks.
#include "cuda_host_emulation.h"
// The kernel after the emulation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/block_gemm.cuh"
#include "dense_view.h"
#include "harness.h"
#include "pyengine/block_gemm.h"
#include "pyengine/errors.h"

namespace {

using pyengine::DType;
using pyengine::TensorView;
using pyengine::cuda::from_float;
using pyengine::cuda::to_float;
using pyengine::emulation::launch;
using pyengine::testing::view;
namespace bg = pyengine::cuda::block_gemm_kernels;

std::mt19937& rng() {
  static std::mt19937 generator(20261201);
  return generator;
}

template <typename T>
const char* type_name() {
  return std::is_same_v<T, __half> ? "half" : "bfloat16";
}

template <typename T>
void gemm_case(int m, int n, int k, int bits, int group, bool with_bias) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> level(bits == 4 ? 0 : -128, bits == 4 ? 15 : 127);
  const int groups = k / group;
  std::vector<uint8_t> q(static_cast<size_t>(n) * k);
  for (auto& v : q) v = static_cast<uint8_t>(level(rng()));
  std::vector<float> scale(static_cast<size_t>(n) * groups), offset(scale.size());
  for (size_t i = 0; i < scale.size(); ++i) {
    scale[i] = 0.02f * std::abs(normal(rng())) + 1e-3f;
    offset[i] = bits == 4 ? -8.0f * scale[i] + 0.01f * normal(rng()) : 0.0f;
  }
  std::vector<float> bias(static_cast<size_t>(n));
  for (auto& b : bias) b = normal(rng());
  std::vector<T> x(static_cast<size_t>(m) * k), out(static_cast<size_t>(m) * n, from_float<T>(NAN));
  for (auto& v : x) v = from_float<T>(normal(rng()));

  std::vector<uint8_t> packed(static_cast<size_t>(pyengine::packed_block_gemm_size(k, n, bits)));
  pyengine::pack_block_gemm_weight(
      view(packed.data(), DType::kUInt8, {static_cast<int64_t>(packed.size())}),
      view(q.data(), bits == 4 ? DType::kUInt8 : DType::kInt8, {n, k}), bits);
  const dim3 grid((n + bg::kWarps * bg::kTileColumns - 1) / (bg::kWarps * bg::kTileColumns),
                  (m + bg::kTileRows - 1) / bg::kTileRows);
  launch(grid, bg::kWarps * 32, [&] {
    const auto kernel = bits == 4 ? bg::block_gemm_kernel<T, 4> : bg::block_gemm_kernel<T, 8>;
    kernel(out.data(), n, x.data(), k, packed.data(), scale.data(), offset.data(),
           with_bias ? bias.data() : nullptr, m, n, k, group);
  });

  double worst = 0.0, largest = 0.0;
  for (int r = 0; r < m; ++r) {
    for (int j = 0; j < n; ++j) {
      double want = with_bias ? bias[j] : 0.0;
      for (int i = 0; i < k; ++i) {
        const int value = bits == 4 ? q[j * k + i] : static_cast<int8_t>(q[j * k + i]);
        const size_t p = static_cast<size_t>(j) * groups + i / group;
        const T w = from_float<T>(std::fma(static_cast<float>(value), scale[p], offset[p]));
        want += static_cast<double>(to_float(x[r * k + i])) * to_float(w);
      }
      worst = std::max(worst, std::abs(to_float(out[r * n + j]) - want));
      largest = std::max(largest, std::abs(want));
    }
  }
  const double tolerance = std::is_same_v<T, __half> ? 2e-3 : 1e-2;
  if (!(worst <= tolerance * std::max(largest, 1.0))) {
    pyengine::testing::fail(__FILE__, __LINE__,
                            std::string("block_gemm <") + type_name<T>() + "> m " +
                                std::to_string(m) + " n " + std::to_string(n) + " k " +
                                std::to_string(k) + " bits " + std::to_string(bits) + " group " +
                                std::to_string(group) + ": error " + std::to_string(worst) +
                                " of " + std::to_string(largest));
  }
}

TEST(block_gemm_matches_float64_of_the_dequantized_weights) {
  for (const auto& [m, n, k] : {std::array{1, 8, 32}, std::array{1, 50, 96},
                                std::array{5, 37, 64}, std::array{16, 32, 32},
                                std::array{21, 70, 128}}) {
    for (const bool bias : {false, true}) {
      gemm_case<__half>(m, n, k, 4, 32, bias);
      gemm_case<__nv_bfloat16>(m, n, k, 4, 32, bias);
      gemm_case<__nv_bfloat16>(m, n, k, 8, 32, bias);
      gemm_case<__half>(m, n, k, 8, 16, bias);
    }
  }
}

TEST(pack_block_gemm_weight_checks_its_operands) {
  std::vector<uint8_t> q(8 * 32, 3), packed(static_cast<size_t>(
                                         pyengine::packed_block_gemm_size(32, 8, 4)));
  const TensorView p = view(packed.data(), DType::kUInt8, {static_cast<int64_t>(packed.size())});
  pyengine::pack_block_gemm_weight(p, view(q.data(), DType::kUInt8, {8, 32}), 4);
  q[40] = 16;
  CHECK_THROWS(pyengine::InvalidArgument,
               pyengine::pack_block_gemm_weight(p, view(q.data(), DType::kUInt8, {8, 32}), 4));
  CHECK_THROWS(pyengine::InvalidArgument, pyengine::packed_block_gemm_size(40, 8, 4));
  CHECK_THROWS(pyengine::InvalidArgument, pyengine::packed_block_gemm_size(32, 8, 5));
  CHECK_THROWS(pyengine::InvalidArgument,
               pyengine::pack_block_gemm_weight(p, view(q.data(), DType::kInt8, {8, 32}), 4));
}

}  // namespace

int main() { return pyengine::testing::run_all(); }
