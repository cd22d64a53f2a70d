// The CUDA fused-layer kernels (cuda/layer_kernels.cuh) run on the host through
// cuda_host_emulation.h, against float64 references on random inputs: every element
// type, with 16-byte packs and one element at a time, on strided rows. The launch
// shapes are the launchers' (threads_for, the silu grid); the GPU tests cover the
// launchers themselves.
#include "cuda_host_emulation.h"
// The kernels after the emulation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/layer_kernels.cuh"
#include "harness.h"

namespace {

using pyengine::cuda::from_float;
using pyengine::cuda::kPackWidth;
using pyengine::cuda::to_float;
using pyengine::emulation::launch;
namespace k = pyengine::cuda::layer_kernels;

std::mt19937& rng() {
  static std::mt19937 generator(20261130);
  return generator;
}

// Storage on 16-byte boundaries, as the kernels' packs need (and cudaMalloc gives).
template <typename T>
struct Aligned {
  using value_type = T;
  Aligned() = default;
  template <typename U>
  Aligned(const Aligned<U>& /*other*/) {}  // NOLINT(google-explicit-constructor)
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new (n * sizeof(T), std::align_val_t{16}));
  }
  void deallocate(T* p, size_t /*n*/) { ::operator delete (p, std::align_val_t{16}); }
  bool operator==(const Aligned& /*other*/) const { return true; }
};
template <typename T>
using Buffer = std::vector<T, Aligned<T>>;

template <typename T>
Buffer<T> random_values(size_t n, float scale = 1.0f, float shift = 0.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  Buffer<T> values(n);
  for (T& v : values) v = from_float<T>(normal(rng()) + shift);
  return values;
}

template <typename T>
double tolerance() {
  if constexpr (std::is_same_v<T, float>) return 1e-5;
  if constexpr (std::is_same_v<T, __half>) return 2e-3;
  return 1e-2;
}

// Largest |got - want| over the largest |want|.
struct Error {
  double worst = 0.0, scale = 0.0;
  template <typename T>
  void add(T got, double want) {
    worst = std::max(worst, std::abs(static_cast<double>(to_float(got)) - want));
    scale = std::max(scale, std::abs(want));
  }
  double relative() const { return scale > 0.0 ? worst / scale : worst; }
};

template <typename T>
const char* type_name() {
  if constexpr (std::is_same_v<T, float>) return "float";
  if constexpr (std::is_same_v<T, __half>) return "half";
  return "bfloat16";
}

template <typename T, int W>
void check_error(const Error& e, const char* op) {
  if (!(e.relative() < tolerance<T>())) {
    pyengine::testing::fail(__FILE__, __LINE__,
                            std::string(op) + " <" + type_name<T>() + ", W=" + std::to_string(W) +
                                ">: relative error " + std::to_string(e.relative()));
  }
}

// 8256 elements: more packs of 8 than the 1024 threads of a block, so that every loop
// runs twice and the block's sums span 32 warps.
constexpr int kRows = 3, kN = 8256, kStride = kN + 8;

template <typename T, int W>
void rms_norm_case() {
  const Buffer<T> x = random_values<T>(kRows * kStride), weight = random_values<T>(kN, 0.3f, 1.0f);
  Buffer<T> out(kRows * kStride, from_float<T>(NAN));
  launch(dim3(kRows), k::threads_for(kN / W), [&] {
    k::rms_norm_kernel<T, W>(out.data(), kStride, x.data(), kStride, weight.data(), kN, 1e-6f);
  });
  Error e;
  for (int r = 0; r < kRows; ++r) {
    double squares = 0.0;
    for (int i = 0; i < kN; ++i) squares += std::pow(to_float(x[r * kStride + i]), 2);
    const double inv = 1.0 / std::sqrt(squares / kN + 1e-6);
    for (int i = 0; i < kN; ++i) {
      e.add(out[r * kStride + i], to_float(weight[i]) * to_float(x[r * kStride + i]) * inv);
    }
  }
  check_error<T, W>(e, "rms_norm");
}

template <typename T, int W>
void fused_add_rms_norm_case() {
  Buffer<T> x = random_values<T>(kRows * kStride), residual = random_values<T>(kRows * kN);
  const Buffer<T> x0 = x, residual0 = residual, weight = random_values<T>(kN, 0.3f, 1.0f);
  launch(dim3(kRows), k::threads_for(kN / W), [&] {
    k::fused_add_rms_norm_kernel<T, W>(x.data(), kStride, residual.data(), kN, weight.data(), kN,
                                       1e-5f);
  });
  Error sums, normed;
  for (int r = 0; r < kRows; ++r) {
    std::vector<double> z(kN);
    double squares = 0.0;
    for (int i = 0; i < kN; ++i) {
      z[i] = static_cast<double>(to_float(x0[r * kStride + i])) + to_float(residual0[r * kN + i]);
      squares += z[i] * z[i];
    }
    const double inv = 1.0 / std::sqrt(squares / kN + 1e-5);
    for (int i = 0; i < kN; ++i) {
      sums.add(residual[r * kN + i], z[i]);
      normed.add(x[r * kStride + i], to_float(weight[i]) * z[i] * inv);
    }
  }
  check_error<T, W>(sums, "fused_add_rms_norm (residual)");
  check_error<T, W>(normed, "fused_add_rms_norm (x)");
}

template <typename T, typename Position, int W>
void rotary_case(bool is_neox) {
  // 300 heads: more packs per token than threads, so the threads' loop runs twice.
  constexpr int kTokens = 4, kQHeads = 200, kKHeads = 100, kD = 64, kHalf = kD / 2;
  constexpr int kMaxPos = 50;
  constexpr int kTokenStride = (kQHeads + 2 * kKHeads) * kD;  // q, k, v of a fused qkv row
  Buffer<T> qkv = random_values<T>(kTokens * kTokenStride);
  const Buffer<T> before = qkv;
  std::vector<float> cos_sin(kMaxPos * kD);
  for (int p = 0; p < kMaxPos; ++p) {
    for (int i = 0; i < kHalf; ++i) {
      const double angle = p * std::pow(10000.0, -2.0 * i / kD);
      cos_sin[p * kD + i] = static_cast<float>(std::cos(angle));
      cos_sin[p * kD + kHalf + i] = static_cast<float>(std::sin(angle));
    }
  }
  const std::vector<Position> positions = {7, 49, kMaxPos, 0};  // kMaxPos: left unrotated
  T* q = qkv.data();
  T* key = qkv.data() + kQHeads * kD;
  launch(dim3(kTokens), k::threads_for((kQHeads + kKHeads) * kD / 2 / W), [&] {
    k::rotary_kernel<T, Position, W>(positions.data(), 1, q, kTokenStride, kQHeads, key,
                                     kTokenStride, kKHeads, kD, cos_sin.data(), kD, kMaxPos,
                                     is_neox);
  });
  Error e;
  bool untouched = true;
  for (int t = 0; t < kTokens; ++t) {
    const int64_t p = positions[t];
    for (int h = 0; h < kQHeads + 2 * kKHeads; ++h) {
      const int row = t * kTokenStride + h * kD;
      const bool rotated = h < kQHeads + kKHeads && p < kMaxPos;
      for (int i = 0; i < kHalf && rotated; ++i) {
        const int a = is_neox ? i : 2 * i, b = is_neox ? kHalf + i : 2 * i + 1;
        const double c = cos_sin[p * kD + i], s = cos_sin[p * kD + kHalf + i];
        const double x = to_float(before[row + a]), y = to_float(before[row + b]);
        e.add(qkv[row + a], x * c - y * s);
        e.add(qkv[row + b], y * c + x * s);
      }
      for (int i = 0; i < kD && !rotated; ++i) {
        untouched = untouched && to_float(qkv[row + i]) == to_float(before[row + i]);
      }
    }
  }
  check_error<T, W>(e, is_neox ? "rotary (rotate-half)" : "rotary (interleaved)");
  CHECK(untouched);  // values, and the token whose position is past the table
}

template <typename T, int W>
void silu_and_mul_case() {
  constexpr int kThreads = 256, kWidth = 5000, kInStride = 2 * kWidth + 16;
  const Buffer<T> x = random_values<T>(kRows * kInStride, 3.0f);
  Buffer<T> out(kRows * kWidth, from_float<T>(NAN));
  const dim3 grid(kRows, (kWidth / W + kThreads - 1) / kThreads);
  launch(grid, kThreads,
         [&] { k::silu_and_mul_kernel<T, W>(out.data(), kWidth, x.data(), kInStride, kWidth); });
  Error e;
  for (int r = 0; r < kRows; ++r) {
    for (int i = 0; i < kWidth; ++i) {
      const double g = to_float(x[r * kInStride + i]), u = to_float(x[r * kInStride + kWidth + i]);
      e.add(out[r * kWidth + i], g / (1.0 + std::exp(-g)) * u);
    }
  }
  check_error<T, W>(e, "silu_and_mul");
}

template <typename T, int W>
void reshape_and_cache_case() {
  constexpr int kTokens = 6, kHeads = 2, kD = 64, kBlock = 8, kBlocks = 4;
  // [tokens, heads, 2, d]: a token's key and value heads lie 2d apart.
  const Buffer<T> kv = random_values<T>(kTokens * kHeads * 2 * kD);
  const std::vector<int64_t> slots = {9, -1, 31, 0, kBlocks * kBlock, 17};  // skip 2 of them
  const size_t cache_size = static_cast<size_t>(kBlocks) * kHeads * kD * kBlock;
  Buffer<T> key_cache(cache_size, from_float<T>(NAN)), value_cache = key_cache;
  launch(dim3(kTokens), k::threads_for(kHeads * kD / W), [&] {
    k::reshape_and_cache_kernel<T, W>(kv.data(), kHeads * 2 * kD, 2 * kD, kv.data() + kD,
                                      kHeads * 2 * kD, 2 * kD, key_cache.data(), value_cache.data(),
                                      slots.data(), 1, kHeads, kD, kBlock, kBlocks * kBlock);
  });
  bool equal = true;
  for (int t = 0; t < kTokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= kBlocks * kBlock) continue;
    const int64_t block = slot / kBlock, offset = slot % kBlock;
    for (int h = 0; h < kHeads; ++h) {
      const int64_t tile = (block * kHeads + h) * kD * kBlock;
      for (int i = 0; i < kD; ++i) {
        const int64_t key_at = tile + i * kBlock + offset, value_at = tile + offset * kD + i;
        const int64_t source = (t * kHeads + h) * 2 * kD + i;
        equal = equal && to_float(key_cache[key_at]) == to_float(kv[source]) &&
                to_float(value_cache[value_at]) == to_float(kv[source + kD]);
      }
    }
  }
  CHECK(equal);
  size_t poisoned_keys = 0, poisoned_values = 0;
  for (size_t i = 0; i < cache_size; ++i) {
    poisoned_keys += std::isnan(to_float(key_cache[i])) ? 1 : 0;
    poisoned_values += std::isnan(to_float(value_cache[i])) ? 1 : 0;
  }
  const size_t stored = 4 * kHeads * kD;  // 4 tokens' heads
  CHECK_EQ(poisoned_keys, cache_size - stored);
  CHECK_EQ(poisoned_values, cache_size - stored);
}

template <typename T, int W>
void every_kernel() {
  rms_norm_case<T, W>();
  fused_add_rms_norm_case<T, W>();
  rotary_case<T, int32_t, W>(true);
  rotary_case<T, int64_t, W>(false);
  silu_and_mul_case<T, W>();
  reshape_and_cache_case<T, W>();
}

}  // namespace

TEST(float32_in_packs_and_elements) {
  every_kernel<float, kPackWidth<float>>();
  every_kernel<float, 1>();
}

TEST(float16_in_packs_and_elements) {
  every_kernel<__half, kPackWidth<__half>>();
  every_kernel<__half, 1>();
}

TEST(bfloat16_in_packs_and_elements) {
  every_kernel<__nv_bfloat16, kPackWidth<__nv_bfloat16>>();
  every_kernel<__nv_bfloat16, 1>();
}

TEST(packs_only_where_pointers_sizes_and_strides_fit) {
  alignas(16) static __nv_bfloat16 data[64];
  const auto width = [](std::initializer_list<const void*> pointers,
                        std::initializer_list<int64_t> counts) {
    int chosen = 0;
    k::with_pack_width<__nv_bfloat16>(pointers, counts,
                                      [&](auto w) { chosen = decltype(w)::value; });
    return chosen;
  };
  CHECK_EQ(width({data, data + 8}, {64, 16}), 8);
  CHECK_EQ(width({data, data + 1}, {64, 16}), 1);  // a pointer 2 bytes past a boundary
  CHECK_EQ(width({data}, {64, 12}), 1);            // a stride of 1.5 packs
  CHECK_EQ(width({data}, {60}), 1);                // a size of 7.5 packs
  CHECK_EQ(kPackWidth<float>, 4);
  CHECK_EQ(kPackWidth<__half>, 8);
}

int main() { return pyengine::testing::run_all(); }
