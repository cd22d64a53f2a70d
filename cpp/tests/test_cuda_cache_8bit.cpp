// The CUDA 8-bit KV caches (cuda/cache_8bit.cuh) run on the host through
// cuda_host_emulation.h. reshape_and_cache_8bit_kernel writes exactly the bytes that the
// CPU's reshape_and_cache (pyengine_core) writes from the same values: fp8 and int8, with
// and without static scales, float16 and bfloat16 K/V, padded and shuffled slots, a row of
// zeros; a slot outside the cache is skipped. The scalar attention kernel over caches so
// written agrees with a float64 reference over the dequantized cache: prefill, chunked
// prefill, decode, split contexts and their merge, GQA groups, head sizes 64, 80 and 128.
#include "cuda_host_emulation.h"
// The kernels after the emulation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/cache_8bit.cuh"
#include "cuda/paged_attention.cuh"
#include "dense_view.h"
#include "harness.h"
#include "normal_values.h"
#include "pyengine/attention.h"

namespace {

using pyengine::DType;
using pyengine::cuda::from_float;
using pyengine::cuda::kCachePad;
using pyengine::cuda::to_float;
using pyengine::emulation::launch;
using pyengine::testing::view;
namespace cuda = pyengine::cuda;
namespace scalar = pyengine::cuda::scalar_attention;

std::mt19937& rng() {
  static std::mt19937 generator(20261203);
  return generator;
}

template <typename C>
constexpr DType cache_dtype() {
  return std::is_same_v<C, int8_t> ? DType::kInt8 : DType::kUInt8;
}
template <typename T, typename C>
std::string name_of() {
  return std::string(std::is_same_v<T, __half> ? "half" : "bfloat16") + " into " +
         (std::is_same_v<C, int8_t> ? "int8" : "fp8");
}

// A pair of 8-bit caches, every byte set to `fill` until written.
struct Caches {
  int num_blocks, num_kv_heads, head_size, block_size, pad;
  std::vector<uint8_t> key, value;
  Caches(int blocks, int heads, int d, int bs, int pad_bytes, uint8_t fill)
      : num_blocks(blocks),
        num_kv_heads(heads),
        head_size(d),
        block_size(bs),
        pad(pad_bytes),
        key(static_cast<size_t>(blocks) * heads * (d + pad_bytes) * bs, fill),
        value(key.size(), fill) {}
  int64_t num_slots() const { return static_cast<int64_t>(num_blocks) * block_size; }
};

// K/V rows [tokens, kv_heads, d] of T, written into `caches` by the emulated kernel.
template <typename T, typename C>
void write_on_cuda(const std::vector<T>& key, const std::vector<T>& value,
                   const std::vector<int64_t>& slots, Caches& c, float k_scale, float v_scale) {
  const auto tokens = static_cast<unsigned>(slots.size());
  const int64_t token_stride = static_cast<int64_t>(c.num_kv_heads) * c.head_size;
  launch(dim3(tokens, c.num_kv_heads), cuda::kWarp, [&] {
    cuda::reshape_and_cache_8bit_kernel<T, C>(
        key.data(), token_stride, c.head_size, value.data(), token_stride, c.head_size,
        reinterpret_cast<C*>(c.key.data()), reinterpret_cast<C*>(c.value.data()), slots.data(), 1,
        c.num_kv_heads, c.head_size, c.block_size, c.num_slots(), k_scale, v_scale);
  });
}

template <typename T>
std::vector<T> random_rows(size_t n, float scale) {
  return pyengine::testing::normal_values<T>(rng(), n, scale);
}

template <typename T, typename C>
void same_bytes_as_the_cpu(int head_size, int block_size, float k_scale, float v_scale) {
  constexpr int kHeads = 2, kBlocks = 5, kTokens = 23;
  const int d = head_size, pad = kCachePad<C>;
  std::vector<T> key = random_rows<T>(static_cast<size_t>(kTokens) * kHeads * d, 2.0f);
  std::vector<T> value = random_rows<T>(key.size(), 0.5f);
  std::fill(key.begin() + 3 * kHeads * d, key.begin() + 3 * kHeads * d + d, from_float<T>(0.0f));
  Caches gpu(kBlocks, kHeads, d, block_size, pad, 0x5A), cpu = gpu;
  std::vector<int64_t> slots(static_cast<size_t>(gpu.num_slots()));
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng());
  slots.resize(kTokens);
  slots[5] = -1;                                      // padding
  std::sort(slots.begin() + 10, slots.begin() + 20);  // a run of consecutive slots, maybe
  write_on_cuda<T, C>(key, value, slots, gpu, k_scale, v_scale);

  std::vector<float> key32(key.size()), value32(value.size());
  for (size_t i = 0; i < key.size(); ++i) key32[i] = to_float(key[i]);
  for (size_t i = 0; i < value.size(); ++i) value32[i] = to_float(value[i]);
  pyengine::reshape_and_cache(
      view(key32.data(), DType::kFloat32, {kTokens, kHeads, d}),
      view(value32.data(), DType::kFloat32, {kTokens, kHeads, d}),
      view(cpu.key.data(), cache_dtype<C>(), {kBlocks, kHeads, d + pad, block_size}),
      view(cpu.value.data(), cache_dtype<C>(), {kBlocks, kHeads, block_size, d + pad}),
      view(slots.data(), DType::kInt64, {kTokens}), k_scale, v_scale);
  for (const auto& [got, want, which] :
       {std::tuple{&gpu.key, &cpu.key, "key"}, std::tuple{&gpu.value, &cpu.value, "value"}}) {
    const auto at = std::mismatch(got->begin(), got->end(), want->begin());
    if (at.first != got->end()) {
      pyengine::testing::fail(__FILE__, __LINE__,
                              name_of<T, C>() + ", head " + std::to_string(d) + ": " + which +
                                  " cache byte " + std::to_string(at.first - got->begin()) +
                                  " is " + std::to_string(*at.first) + ", the CPU's " +
                                  std::to_string(*at.second));
    }
  }
  // A slot past the cache (never checked on the device) writes nothing.
  const Caches before = gpu;
  write_on_cuda<T, C>(key, value, std::vector<int64_t>(1, gpu.num_slots()), gpu, k_scale, v_scale);
  CHECK(gpu.key == before.key && gpu.value == before.value);
}

// Element (dim, key) of a request's cache, dequantized: for int8 the stored integer times
// its token's scale, for fp8 the e4m3 value.
template <typename C>
double cached(const Caches& c, const std::vector<uint8_t>& cache, bool is_key, int64_t block,
              int head, int dim, int offset) {
  const int d = c.head_size, bs = c.block_size, pad = c.pad;
  const int64_t tile = (block * c.num_kv_heads + head) * static_cast<int64_t>(d + pad) * bs;
  const int64_t at = tile + (is_key ? static_cast<int64_t>(dim) * bs + offset
                                    : static_cast<int64_t>(offset) * (d + pad) + dim);
  C element;
  std::memcpy(&element, &cache[static_cast<size_t>(at)], 1);
  double x = to_float(element);
  if (pad > 0) {
    const int64_t scale_at = is_key ? tile + static_cast<int64_t>(d) * bs + offset * pad
                                    : tile + static_cast<int64_t>(offset) * (d + pad) + d;
    float scale;
    std::memcpy(&scale, &cache[static_cast<size_t>(scale_at)], sizeof scale);
    x *= scale;
  }
  return x;
}

struct Requests {
  std::vector<int> query_lens, seq_lens;
};

template <typename T, typename C, int D>
void attention_case(int num_heads, int num_kv_heads, int block_size, const Requests& rq,
                    int num_parts) {
  const int n = static_cast<int>(rq.seq_lens.size()), bs = block_size;
  std::vector<std::vector<int>> blocks(n);
  int total_blocks = 0, max_blocks = 0;
  for (int r = 0; r < n; ++r) {
    const int needed = (rq.seq_lens[r] + bs - 1) / bs;
    total_blocks += needed;
    max_blocks = std::max(max_blocks, needed + 1);
  }
  std::vector<int> ids(total_blocks + 2);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng());
  Caches caches(total_blocks + 2, num_kv_heads, D, bs, kCachePad<C>, 0xFF);  // NaN in both
  std::vector<int32_t> tables(static_cast<size_t>(n) * max_blocks, -3);      // stale past the end
  std::vector<int64_t> slots;
  for (int r = 0, next = 0; r < n; ++r) {
    for (int key = 0; key < rq.seq_lens[r]; key += bs) blocks[r].push_back(ids[next++]);
    for (size_t i = 0; i < blocks[r].size(); ++i) tables[r * max_blocks + i] = blocks[r][i];
    for (int key = 0; key < rq.seq_lens[r]; ++key) {
      slots.push_back(static_cast<int64_t>(blocks[r][key / bs]) * bs + key % bs);
    }
  }
  const size_t kv_size = slots.size() * num_kv_heads * D;
  write_on_cuda<T, C>(random_rows<T>(kv_size, 1.5f), random_rows<T>(kv_size, 1.0f), slots, caches,
                      0.0f, 0.0f);

  std::vector<int32_t> qsl(1, 0);
  for (const int q : rq.query_lens) qsl.push_back(qsl.back() + q);
  const int tokens = qsl.back();
  const std::vector<T> query = random_rows<T>(static_cast<size_t>(tokens) * num_heads * D, 1.0f);
  std::vector<T> out(query.size(), from_float<T>(NAN));
  std::vector<float> partials(query.size() / D * num_parts * (D + 2), NAN);
  std::vector<int32_t> seq_lens(rq.seq_lens.begin(), rq.seq_lens.end());

  cuda::AttentionParams p{};
  p.query = query.data();
  p.key_cache = caches.key.data();
  p.value_cache = caches.value.data();
  p.block_tables = tables.data();
  p.seq_lens = seq_lens.data();
  p.query_start_loc = qsl.data();
  p.out = out.data();
  p.partials = num_parts > 1 ? partials.data() : nullptr;
  p.q_token_stride = p.o_token_stride = static_cast<int64_t>(num_heads) * D;
  p.q_head_stride = p.o_head_stride = D;
  p.max_blocks = max_blocks;
  p.num_blocks = caches.num_blocks;
  p.num_reqs = n;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_size = D;
  p.block_size = bs;
  p.num_parts = num_parts;
  p.scale = 1.0f / std::sqrt(static_cast<float>(D));
  constexpr int kLanes = (D + cuda::kWarp - 1) / cuda::kWarp;
  launch(dim3(tokens, num_heads, num_parts), scalar::kThreads,
         [&] { scalar::attention_kernel<T, C, kLanes>(p); });
  if (num_parts > 1) {
    launch(dim3(tokens, num_heads), scalar::kThreads, [&] { scalar::merge_kernel<T>(p); });
  }

  double worst = 0.0, largest = 0.0;
  const int group = num_heads / num_kv_heads;
  for (int r = 0; r < n; ++r) {
    for (int i = 0; i < rq.query_lens[r]; ++i) {
      const int token = qsl[r] + i, position = rq.seq_lens[r] - rq.query_lens[r] + i;
      for (int h = 0; h < num_heads; ++h) {
        const size_t row = (static_cast<size_t>(token) * num_heads + h) * D;
        const int kvh = h / group;
        std::vector<double> weights;
        for (int key = 0; key <= position; ++key) {
          double s = 0.0;
          for (int x = 0; x < D; ++x) {
            s += to_float(query[row + x]) *
                 cached<C>(caches, caches.key, true, blocks[r][key / bs], kvh, x, key % bs);
          }
          weights.push_back(s / std::sqrt(static_cast<double>(D)));
        }
        const double top = *std::max_element(weights.begin(), weights.end());
        double total = 0.0;
        for (double& w : weights) total += (w = std::exp(w - top));
        for (int x = 0; x < D; ++x) {
          double want = 0.0;
          for (int key = 0; key <= position; ++key) {
            want += weights[key] / total *
                    cached<C>(caches, caches.value, false, blocks[r][key / bs], kvh, x, key % bs);
          }
          const double got = to_float(out[row + x]);
          largest = std::max(largest, std::abs(want));
          worst = std::max(worst, std::isfinite(got) ? std::abs(got - want) : INFINITY);
        }
      }
    }
  }
  const double tolerance = std::is_same_v<T, __half> ? 5e-3 : 2e-2;  // the output's rounding
  if (!(worst / largest < tolerance)) {
    pyengine::testing::fail(__FILE__, __LINE__,
                            name_of<T, C>() + ", head " + std::to_string(D) + ": relative error " +
                                std::to_string(worst / largest));
  }
}

}  // namespace

TEST(the_cuda_writer_stores_the_cpus_bytes) {
  same_bytes_as_the_cpu<__half, int8_t>(64, 16, 0.0f, 0.0f);
  same_bytes_as_the_cpu<__nv_bfloat16, int8_t>(80, 8, 0.0f, 0.0f);
  same_bytes_as_the_cpu<__half, int8_t>(128, 4, 0.02f, 0.01f);  // static scales clamp
  same_bytes_as_the_cpu<__half, __nv_fp8_e4m3>(64, 16, 0.0f, 0.0f);
  same_bytes_as_the_cpu<__nv_bfloat16, __nv_fp8_e4m3>(80, 32, 0.0f, 0.0f);
  same_bytes_as_the_cpu<__nv_bfloat16, __nv_fp8_e4m3>(64, 16, 0.004f, 0.5f);  // saturates
}

TEST(attention_over_int8_caches) {
  attention_case<__half, int8_t, 64>(4, 2, 16, {{37, 1, 1}, {37, 100, 17}}, 1);
  attention_case<__nv_bfloat16, int8_t, 128>(8, 2, 8, {{20, 1}, {50, 33}}, 1);
  attention_case<__half, int8_t, 80>(2, 1, 16, {{1, 3}, {600, 260}}, 3);
}

TEST(attention_over_fp8_caches) {
  attention_case<__nv_bfloat16, __nv_fp8_e4m3, 64>(4, 1, 16, {{5, 1}, {5, 90}}, 1);
  attention_case<__half, __nv_fp8_e4m3, 128>(4, 2, 32, {{1, 12}, {600, 300}}, 2);
  attention_case<__half, __nv_fp8_e4m3, 80>(6, 3, 8, {{9, 1}, {40, 70}}, 1);
}

int main() { return pyengine::testing::run_all(); }
