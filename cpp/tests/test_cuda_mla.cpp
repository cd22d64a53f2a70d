// The CUDA multi-head latent attention kernel (cuda/mla_attention.cuh) runs on the host
// through cuda_host_emulation.h, with the scalar kernel's merge of split contexts, against
// a float64 reference: shuffled block tables, stale table entries, poisoned slots past
// each context and a poisoned output; prefill, chunked prefill over a cached prefix and
// decode, a context split into partitions (some of them empty), float32, float16 and
// bfloat16, DeepSeek's latent of 512 + 64 with a value of 512.
#include "cuda_host_emulation.h"
// The kernel after the emulation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/mla_attention.cuh"
#include "cuda/paged_attention.cuh"
#include "harness.h"

namespace {

using pyengine::cuda::AttentionParams;
using pyengine::cuda::from_float;
using pyengine::cuda::to_float;
namespace mla = pyengine::cuda::mla;
namespace scalar = pyengine::cuda::scalar_attention;

std::mt19937& rng() {
  static std::mt19937 generator(11);
  return generator;
}

struct Case {
  int latent, value, num_heads, block_size;
  std::vector<int> query_lens, seq_lens;  // per request
  int num_parts = 1;
};

template <typename T>
struct Buffers {
  std::vector<T> query, cache, out;
  std::vector<int32_t> block_tables, seq_lens, query_start_loc;
  std::vector<float> partials;
  std::vector<std::vector<int>> blocks;  // each request's block ids, in order
  int num_blocks = 0, max_blocks = 0, num_tokens = 0;
};

template <typename T>
Buffers<T> make_buffers(const Case& c) {
  Buffers<T> b;
  const int d = c.latent, bs = c.block_size, n = static_cast<int>(c.seq_lens.size());
  std::vector<int> needed(n);
  for (int r = 0; r < n; ++r) {
    needed[r] = (c.seq_lens[r] + bs - 1) / bs;
    b.max_blocks = std::max(b.max_blocks, needed[r] + 2);  // stale entries past the end
  }
  b.num_blocks = std::accumulate(needed.begin(), needed.end(), 0) + 3;  // 3 never used
  std::vector<int> ids(b.num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng());
  std::normal_distribution<float> normal;
  const T poison = from_float<T>(NAN);
  b.cache.assign(static_cast<size_t>(b.num_blocks) * bs * d, poison);
  b.block_tables.assign(static_cast<size_t>(n) * b.max_blocks, 0);
  size_t next = 0;
  for (int r = 0; r < n; ++r) {
    b.blocks.emplace_back(ids.begin() + next, ids.begin() + next + needed[r]);
    next += needed[r];
    for (int i = 0; i < b.max_blocks; ++i) {
      const int stale = i % 2 ? -5 : b.num_blocks + 7;  // outside the cache
      b.block_tables[r * b.max_blocks + i] = i < needed[r] ? b.blocks[r][i] : stale;
    }
    for (int key = 0; key < c.seq_lens[r]; ++key) {  // slots past the context stay NaN
      const int64_t row = (static_cast<int64_t>(b.blocks[r][key / bs]) * bs + key % bs) * d;
      for (int i = 0; i < d; ++i) b.cache[row + i] = from_float<T>(normal(rng()));
    }
  }
  b.seq_lens.assign(c.seq_lens.begin(), c.seq_lens.end());
  b.query_start_loc.assign(1, 0);
  for (const int q : c.query_lens) b.query_start_loc.push_back(b.query_start_loc.back() + q);
  b.num_tokens = b.query_start_loc.back();
  const size_t rows = static_cast<size_t>(b.num_tokens) * c.num_heads;
  b.query.resize(rows * d);
  for (T& x : b.query) x = from_float<T>(normal(rng()));
  b.out.assign(rows * c.value, poison);
  b.partials.assign(rows * c.num_parts * (c.value + 2), NAN);
  return b;
}

template <typename T>
AttentionParams params(const Case& c, Buffers<T>& b) {
  AttentionParams p{};
  p.query = b.query.data();
  p.key_cache = b.cache.data();
  p.block_tables = b.block_tables.data();
  p.seq_lens = b.seq_lens.data();
  p.query_start_loc = b.query_start_loc.data();
  p.out = b.out.data();
  p.partials = c.num_parts > 1 ? b.partials.data() : nullptr;
  p.q_token_stride = static_cast<int64_t>(c.num_heads) * c.latent;
  p.q_head_stride = c.latent;
  p.o_token_stride = static_cast<int64_t>(c.num_heads) * c.value;
  p.o_head_stride = c.value;
  p.max_blocks = b.max_blocks;
  p.num_blocks = b.num_blocks;
  p.num_reqs = static_cast<int>(c.seq_lens.size());
  p.num_heads = c.num_heads;
  p.num_kv_heads = 1;
  p.head_size = c.value;
  p.block_size = c.block_size;
  p.num_parts = c.num_parts;
  p.scale = 0.5f / std::sqrt(static_cast<float>(c.latent));
  return p;
}

// The output against the float64 reference over the same rounded inputs: largest error
// over largest value.
template <typename T>
double relative_error(const Case& c, const Buffers<T>& b, float scale) {
  const int d = c.latent, bs = c.block_size;
  double worst = 0.0, largest = 0.0;
  for (size_t r = 0; r < c.seq_lens.size(); ++r) {
    const int q_len = c.query_lens[r], seq_len = c.seq_lens[r];
    const auto row_of = [&](int key) {
      return (static_cast<int64_t>(b.blocks[r][key / bs]) * bs + key % bs) * d;
    };
    for (int i = 0; i < q_len; ++i) {
      const int token = b.query_start_loc[r] + i, position = seq_len - q_len + i;
      for (int h = 0; h < c.num_heads; ++h) {
        const size_t row = static_cast<size_t>(token) * c.num_heads + h;
        std::vector<double> scores;
        for (int key = 0; key <= position; ++key) {
          double s = 0.0;
          for (int x = 0; x < d; ++x) {
            s += static_cast<double>(to_float(b.query[row * d + x])) *
                 to_float(b.cache[row_of(key) + x]);
          }
          scores.push_back(s * scale);
        }
        const double top = *std::max_element(scores.begin(), scores.end());
        double total = 0.0;
        for (double& s : scores) total += (s = std::exp(s - top));
        for (int x = 0; x < c.value; ++x) {
          double want = 0.0;
          for (int key = 0; key <= position; ++key) {
            want += scores[key] / total * to_float(b.cache[row_of(key) + x]);
          }
          const double got = to_float(b.out[row * c.value + x]);
          largest = std::max(largest, std::abs(want));
          worst = std::max(worst, std::isfinite(got) ? std::abs(got - want) : INFINITY);
        }
      }
    }
  }
  return worst / largest;
}

template <typename T>
void check_case(const Case& c, const char* what) {
  using pyengine::emulation::launch;
  Buffers<T> b = make_buffers<T>(c);
  const AttentionParams p = params(c, b);
  launch(dim3(b.num_tokens, c.num_heads, c.num_parts), mla::kThreads,
         [&] { mla::mla_kernel<T>(p, c.latent); });
  if (c.num_parts > 1) {
    launch(dim3(b.num_tokens, c.num_heads), scalar::kThreads, [&] { scalar::merge_kernel<T>(p); });
  }
  const double error = relative_error(c, b, p.scale);
  const double tolerance = std::is_same_v<T, float>    ? 1e-5
                           : std::is_same_v<T, __half> ? 5e-3
                                                       : 2e-2;
  if (!(error < tolerance)) {
    pyengine::testing::fail(__FILE__, __LINE__,
                            std::string(what) + ": relative error " + std::to_string(error));
  }
}

}  // namespace

TEST(prefill_and_chunked_prefill_float32) {
  check_case<float>({96, 64, 4, 16, {37, 20}, {37, 50}}, "prefill, and a chunk on a prefix");
}

TEST(decode_of_deepseeks_latent_bfloat16) {
  check_case<__nv_bfloat16>({576, 512, 2, 16, {1, 1, 1}, {70, 5, 140}}, "decode, 512 + 64");
}

TEST(split_contexts_then_the_merge) {
  // (the short request's later partitions hold no keys: the merge skips them)
  Case c{576, 512, 2, 16, {1, 2}, {900, 30}};
  c.num_parts = 4;
  check_case<__half>(c, "decode over 4 partitions");
  Case f{64, 32, 3, 8, {1, 4}, {700, 300}};
  f.num_parts = 3;
  check_case<float>(f, "float32 over 3 partitions");
}

int main() { return pyengine::testing::run_all(); }
