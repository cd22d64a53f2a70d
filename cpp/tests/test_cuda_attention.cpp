// The CUDA paged-attention kernels run on the host through cuda_host_emulation.h (mma,
// ldmatrix and cp.async emulated lane by lane): the tensor-core kernel
// (cuda/flash_attention.cuh, float16/bfloat16), the scalar kernel (cuda/paged_attention.cuh,
// float32 and other head sizes) and the merge of split contexts, against a float64
// reference: shuffled block tables, stale table entries, poisoned slots past each
// context and a poisoned output; prefill, chunked prefill over a cached prefix, decode
// (one-warp blocks), split-K partitions, GQA groups, sliding windows and soft-capping.
// The tensor-core launch shape is the launcher's (plan_launch).
#include "cuda_host_emulation.h"
// The kernel after the emulation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/flash_attention.cuh"
#include "cuda/paged_attention.cuh"
#include "harness.h"

namespace {

constexpr int kWarpLanes = 32;
using pyengine::cuda::AttentionParams;
using pyengine::cuda::from_float;
using pyengine::cuda::to_float;
namespace flash = pyengine::cuda::flash;
namespace scalar = pyengine::cuda::scalar_attention;

std::mt19937& rng() {
  static std::mt19937 generator(7);
  return generator;
}

struct Case {
  int head_size, num_heads, num_kv_heads, block_size;
  std::vector<int> query_lens, seq_lens;  // per request
  int sliding_window = 0;
  int attention_chunk = 0;  // Llama 4's chunked local attention
  bool released = false;    // blocks before a request's first visible one: a NaN block
  float logit_soft_cap = 0.0f;
  int num_parts = 1;
  int max_query_len_hint = 0;  // the launch's hint; 0: the true largest query length
  bool sinks = false;          // each head a random sink logit (gpt-oss's)
};

// The first key a query at `position` sees.
int first_visible(const Case& c, int position) {
  int first = c.sliding_window > 0 ? std::max(0, position - c.sliding_window + 1) : 0;
  if (c.attention_chunk > 0) first = std::max(first, position - position % c.attention_chunk);
  return first;
}

template <typename T>
struct Buffers {
  std::vector<T> query, key_cache, value_cache, out;
  std::vector<int32_t> block_tables, seq_lens, query_start_loc;
  std::vector<float> partials, sinks;
  std::vector<std::vector<int>> blocks;  // each request's block ids, in order
  int num_blocks = 0, max_blocks = 0, num_tokens = 0;
};

template <typename T>
Buffers<T> make_buffers(const Case& c) {
  Buffers<T> b;
  const int d = c.head_size, bs = c.block_size, n = static_cast<int>(c.seq_lens.size());
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
  const size_t cache = static_cast<size_t>(b.num_blocks) * c.num_kv_heads * d * bs;
  b.key_cache.assign(cache, poison);
  b.value_cache.assign(cache, poison);
  b.block_tables.assign(static_cast<size_t>(n) * b.max_blocks, 0);
  size_t next = 0;
  for (int r = 0; r < n; ++r) {
    b.blocks.emplace_back(ids.begin() + next, ids.begin() + next + needed[r]);
    next += needed[r];
    for (int i = 0; i < b.max_blocks; ++i) {
      // Past the request's blocks: an id outside the cache, and one of another request's.
      const int stale = i % 2 ? -5 : b.num_blocks + 7;
      b.block_tables[r * b.max_blocks + i] = i < needed[r] ? b.blocks[r][i] : stale;
    }
    for (int key = 0; key < c.seq_lens[r]; ++key) {  // slots past the context stay NaN
      const int64_t block = b.blocks[r][key / bs], offset = key % bs;
      for (int h = 0; h < c.num_kv_heads; ++h) {
        const int64_t tile = (block * c.num_kv_heads + h) * d * bs;
        for (int i = 0; i < d; ++i) {
          b.key_cache[tile + i * bs + offset] = from_float<T>(normal(rng()));
          b.value_cache[tile + offset * d + i] = from_float<T>(normal(rng()));
        }
      }
    }
  }
  // As a window's KV-cache group leaves them: entries before each request's first query's
  // first visible block point at a never-written (NaN) block, which no kernel may read.
  for (int r = 0; c.released && r < n; ++r) {
    const int first_block = first_visible(c, c.seq_lens[r] - c.query_lens[r]) / bs;
    for (int i = 0; i < first_block; ++i) b.block_tables[r * b.max_blocks + i] = ids.back();
  }
  b.seq_lens.assign(c.seq_lens.begin(), c.seq_lens.end());
  b.query_start_loc.assign(1, 0);
  for (const int q : c.query_lens) b.query_start_loc.push_back(b.query_start_loc.back() + q);
  b.num_tokens = b.query_start_loc.back();
  const size_t rows = static_cast<size_t>(b.num_tokens) * c.num_heads;
  b.query.resize(rows * d);
  for (T& x : b.query) x = from_float<T>(normal(rng()));
  b.out.assign(rows * d, poison);
  b.partials.assign(rows * c.num_parts * (d + 2), NAN);
  if (c.sinks) {
    for (int h = 0; h < c.num_heads; ++h) b.sinks.push_back(2.0f * normal(rng()));
  }
  return b;
}

template <typename T>
AttentionParams params(const Case& c, Buffers<T>& b) {
  AttentionParams p{};
  p.query = b.query.data();
  p.key_cache = b.key_cache.data();
  p.value_cache = b.value_cache.data();
  p.block_tables = b.block_tables.data();
  p.seq_lens = b.seq_lens.data();
  p.query_start_loc = b.query_start_loc.data();
  p.out = b.out.data();
  p.partials = c.num_parts > 1 ? b.partials.data() : nullptr;
  p.q_token_stride = p.o_token_stride = static_cast<int64_t>(c.num_heads) * c.head_size;
  p.q_head_stride = p.o_head_stride = c.head_size;
  p.max_blocks = b.max_blocks;
  p.num_blocks = b.num_blocks;
  p.num_reqs = static_cast<int>(c.seq_lens.size());
  p.num_heads = c.num_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.head_size = c.head_size;
  p.block_size = c.block_size;
  p.num_parts = c.num_parts;
  p.scale = 1.0f / std::sqrt(static_cast<float>(c.head_size));
  p.sliding_window = c.sliding_window;
  p.attention_chunk = c.attention_chunk;
  p.logit_soft_cap = c.logit_soft_cap;
  p.sinks = c.sinks ? b.sinks.data() : nullptr;
  return p;
}

enum class Kernel { kFlash, kScalar };

// The kernel, then the merge where the contexts are split, as the dispatch runs them (the
// test picks the kernel and the number of partitions itself).
template <typename T, int D>
void run(AttentionParams p, Kernel kernel, int num_tokens, int max_query_len, int prefill_warps) {
  using pyengine::emulation::launch;
  if (kernel == Kernel::kScalar) {
    const dim3 grid(num_tokens, p.num_heads, p.num_parts);
    launch(grid, scalar::kThreads,
           [&] { scalar::attention_kernel<T, T, (D + kWarpLanes - 1) / kWarpLanes>(p); });
  } else {
    const flash::Launch shape = flash::plan_launch(p, max_query_len, prefill_warps);
    const dim3 grid(shape.grid_x, shape.grid_y, shape.grid_z);
    constexpr bool kFlashShape = D == 64 || D == 80 || D == 96 || D == 128 || D == 256;
    if constexpr (kFlashShape && !std::is_same_v<T, float>) {
      if (shape.warps == 1) {
        launch(
            grid, 32, [&] { flash::flash_attention_kernel<T, D, 1>(p); },
            flash::shared_bytes<T, D, 1>());
      } else if (shape.warps == 4) {
        launch(
            grid, 4 * 32, [&] { flash::flash_attention_kernel<T, D, 4>(p); },
            flash::shared_bytes<T, D, 4>());
      } else {
        launch(
            grid, 8 * 32, [&] { flash::flash_attention_kernel<T, D, 8>(p); },
            flash::shared_bytes<T, D, 8>());
      }
    }
  }
  if (p.num_parts > 1) {
    launch(dim3(num_tokens, p.num_heads), scalar::kThreads, [&] { scalar::merge_kernel<T>(p); });
  }
}

// The output against the float64 reference over the same rounded inputs: largest error
// over largest value.
template <typename T>
double relative_error(const Case& c, const Buffers<T>& b) {
  const int d = c.head_size, bs = c.block_size, group = c.num_heads / c.num_kv_heads;
  double worst = 0.0, largest = 0.0;
  for (size_t r = 0; r < c.seq_lens.size(); ++r) {
    const int q_len = c.query_lens[r], seq_len = c.seq_lens[r];
    for (int i = 0; i < q_len; ++i) {
      const int token = b.query_start_loc[r] + i, position = seq_len - q_len + i;
      const int first = first_visible(c, position);
      for (int h = 0; h < c.num_heads; ++h) {
        const int kvh = h / group;
        const size_t row = static_cast<size_t>(token) * c.num_heads + h;
        std::vector<double> scores;
        for (int key = first; key <= position; ++key) {
          const int64_t tile = (b.blocks[r][key / bs] * c.num_kv_heads + kvh) * d * bs;
          double s = 0.0;
          for (int x = 0; x < d; ++x) {
            s += static_cast<double>(to_float(b.query[row * d + x])) *
                 to_float(b.key_cache[tile + x * bs + key % bs]);
          }
          s /= std::sqrt(static_cast<double>(d));
          if (c.logit_soft_cap > 0) s = c.logit_soft_cap * std::tanh(s / c.logit_soft_cap);
          scores.push_back(s);
        }
        const double top = *std::max_element(scores.begin(), scores.end());
        double total = c.sinks ? std::exp(static_cast<double>(b.sinks[h]) - top) : 0.0;
        for (double& s : scores) total += (s = std::exp(s - top));
        std::vector<double> got(d);
        for (int x = 0; x < d; ++x) got[x] = to_float(b.out[row * d + x]);
        for (int x = 0; x < d; ++x) {
          double want = 0.0;
          for (int key = first; key <= position; ++key) {
            const int64_t tile = (b.blocks[r][key / bs] * c.num_kv_heads + kvh) * d * bs;
            want +=
                scores[key - first] / total * to_float(b.value_cache[tile + (key % bs) * d + x]);
          }
          largest = std::max(largest, std::abs(want));
          worst = std::max(worst, std::isfinite(got[x]) ? std::abs(got[x] - want) : INFINITY);
        }
      }
    }
  }
  return worst / largest;
}

template <typename T, int D>
void check_case(const Case& c, const char* what, Kernel kernel = Kernel::kFlash,
                int prefill_warps = flash::kPrefillWarps) {
  Buffers<T> b = make_buffers<T>(c);
  const int max_query = c.max_query_len_hint > 0
                            ? c.max_query_len_hint
                            : *std::max_element(c.query_lens.begin(), c.query_lens.end());
  run<T, D>(params(c, b), kernel, b.num_tokens, max_query, prefill_warps);
  const double error = relative_error(c, b);
  const double tolerance = std::is_same_v<T, float>    ? 1e-5
                           : std::is_same_v<T, __half> ? 5e-3
                                                       : 2e-2;
  if (!(error < tolerance)) {
    pyengine::testing::fail(__FILE__, __LINE__,
                            std::string(what) + ": relative error " + std::to_string(error));
  }
}

}  // namespace

TEST(prefill_of_fresh_prompts_float16) {
  check_case<__half, 64>({64, 4, 2, 16, {37, 5, 64}, {37, 5, 64}}, "prefill, group 2");
}

TEST(chunked_prefill_over_a_cached_prefix_bfloat16) {
  check_case<__nv_bfloat16, 128>({128, 8, 2, 8, {20, 33}, {50, 33}}, "chunked prefill, group 4");
}

TEST(decode_in_one_warp_blocks) {
  check_case<__nv_bfloat16, 64>({64, 4, 1, 16, {1, 1, 1}, {100, 17, 300}}, "decode, group 4");
  check_case<__half, 96>({96, 2, 2, 32, {1, 2}, {70, 9}}, "decode, head 96");
}

TEST(split_k_partitions_then_the_merge) {
  Case c{128, 4, 2, 16, {1, 3}, {600, 260}};
  c.num_parts = 3;
  check_case<__half, 128>(c, "decode over 3 partitions");
}

TEST(scalar_kernel_float32) {
  check_case<float, 128>({128, 4, 2, 16, {37, 5}, {37, 45}}, "prefill", Kernel::kScalar);
  Case c{128, 8, 8, 8, {1, 1, 1}, {700, 3, 260}};
  c.num_parts = 2;
  check_case<float, 128>(c, "decode over 2 partitions", Kernel::kScalar);
}

TEST(scalar_kernel_for_head_sizes_the_tensor_cores_skip) {
  check_case<__nv_bfloat16, 112>({112, 4, 1, 16, {1, 6}, {90, 6}}, "head 112", Kernel::kScalar);
  Case c{32, 4, 2, 8, {25}, {40}};
  c.sliding_window = 9;
  c.logit_soft_cap = 5.0f;
  check_case<__half, 32>(c, "head 32, window 9, cap 5", Kernel::kScalar);
  check_case<float, 192>({192, 2, 1, 32, {3}, {33}}, "head 192", Kernel::kScalar);
}

TEST(sliding_window_and_soft_cap) {
  Case c{64, 6, 2, 8, {30, 1}, {45, 80}};
  c.sliding_window = 20;
  c.logit_soft_cap = 30.0f;
  check_case<__nv_bfloat16, 64>(c, "window 20, cap 30");
  // A capped partition's maximum goes to the merge in the same units as an uncapped one's.
  Case split{128, 4, 2, 16, {1, 12}, {600, 300}};
  split.logit_soft_cap = 3.0f;
  split.num_parts = 2;
  check_case<__half, 128>(split, "cap 3 over 2 partitions");
}

TEST(chunked_attention_and_released_blocks_in_every_kernel) {
  Case prefill{64, 4, 2, 16, {30, 1, 50}, {45, 80, 120}};
  prefill.attention_chunk = 32;
  prefill.released = true;
  check_case<__nv_bfloat16, 64>(prefill, "chunks of 32, released blocks");
  check_case<__half, 64>(prefill, "chunks of 32, released blocks, scalar", Kernel::kScalar);
  prefill.sliding_window = 20;
  check_case<__nv_bfloat16, 64>(prefill, "window 20 in chunks of 32");
  Case split{128, 4, 2, 16, {1, 12}, {600, 300}};
  split.attention_chunk = 256;
  split.released = true;
  split.num_parts = 2;
  check_case<__half, 128>(split, "chunks of 256 over 2 partitions");
  check_case<float, 128>(split, "chunks of 256 over 2 partitions, scalar", Kernel::kScalar);
  Case window{64, 4, 2, 16, {3}, {200}};
  window.sliding_window = 40;
  window.released = true;
  check_case<__nv_bfloat16, 64>(window, "window 40, released blocks");
}

TEST(attention_sinks_in_every_kernel_and_the_merge) {
  Case prefill{64, 4, 2, 16, {30, 1}, {45, 80}};
  prefill.sinks = true;
  prefill.sliding_window = 20;
  check_case<__nv_bfloat16, 64>(prefill, "sinks, window 20");
  check_case<__half, 64>(prefill, "sinks, scalar", Kernel::kScalar);
  Case split{128, 4, 2, 16, {1, 12}, {600, 300}};
  split.sinks = true;
  split.num_parts = 2;
  check_case<__half, 128>(split, "sinks over 2 partitions");
  check_case<float, 128>(split, "sinks over 2 partitions, scalar", Kernel::kScalar);
}

TEST(head_sizes_80_96_and_256) {
  // 80 and 96 leave the last of a thread's K copies past the head for some threads.
  check_case<__nv_bfloat16, 80>({80, 2, 1, 16, {9, 40}, {9, 70}}, "head 80");
  check_case<__half, 96>({96, 4, 2, 16, {30, 2}, {45, 2}}, "head 96");
  check_case<__half, 256>({256, 2, 2, 8, {12}, {20}}, "head 256");
}

int main() { return pyengine::testing::run_all(); }

TEST(group_sizes_block_sizes_and_empty_queries) {
  // Group 3 leaves tile rows unused (42 tokens of 3 heads in 128 rows); 64 fills a tile
  // with two tokens.
  check_case<__nv_bfloat16, 64>({64, 9, 3, 32, {40, 7}, {40, 60}}, "group 3, blocks of 32");
  check_case<__half, 64>({64, 64, 1, 64, {3, 1}, {130, 64}}, "group 64, blocks of 64");
  check_case<__half, 64>({64, 16, 2, 16, {2, 1}, {33, 128}}, "group 8, decode of 2 tokens");
  // A request without query tokens this step, between two that have some.
  check_case<__nv_bfloat16, 128>({128, 4, 2, 16, {5, 0, 32}, {70, 40, 64}}, "an empty query");
  check_case<float, 64>({64, 4, 2, 16, {5, 0, 3}, {70, 40, 3}}, "an empty query (scalar)",
                        Kernel::kScalar);
}

TEST(a_short_max_query_len_hint_costs_speed_not_results) {
  // A hint of 1 for prompts of 40 and 9 tokens: one-warp blocks, each over many tiles.
  Case c{64, 4, 2, 16, {40, 9}, {40, 30}};
  c.max_query_len_hint = 1;
  check_case<__half, 64>(c, "hint 1 for 40 tokens");
  // Group 8: prefill blocks of 16 tokens; a hint of 17 makes two blocks a request, one of
  // them over two tiles.
  Case g{64, 16, 2, 16, {40, 9}, {40, 30}};
  g.max_query_len_hint = 17;
  check_case<__nv_bfloat16, 64>(g, "hint 17 for 40 tokens");
  // Head 128, a long cached prefix: each tile streams 16 chunks three deep, and the block
  // starts its second tile's pipeline where the first one's ended.
  Case deep{128, 8, 2, 16, {40}, {1000}};
  deep.max_query_len_hint = 17;
  check_case<__nv_bfloat16, 128>(deep, "hint 17 for 40 tokens after 960");
}

TEST(prefill_in_four_warp_blocks) {  // PYENGINE_FLASH_PREFILL_WARPS=4
  constexpr Kernel kFlash = Kernel::kFlash;
  check_case<__half, 64>({64, 4, 2, 16, {37, 5, 64}, {37, 5, 64}}, "prefill, group 2", kFlash, 4);
  check_case<__nv_bfloat16, 128>({128, 8, 2, 8, {20, 33}, {50, 33}}, "chunked, group 4", kFlash, 4);
  check_case<__half, 96>({96, 4, 2, 16, {30, 2}, {45, 2}}, "head 96", kFlash, 4);
  check_case<__half, 256>({256, 2, 2, 8, {12}, {20}}, "head 256", kFlash, 4);
  check_case<__half, 64>({64, 64, 1, 64, {3, 1}, {130, 64}}, "group 64", kFlash, 4);
  Case c{64, 4, 2, 16, {40, 9}, {40, 30}};
  c.max_query_len_hint = 17;  // one block a request, over two tiles
  c.num_parts = 2;
  check_case<__nv_bfloat16, 64>(c, "hint 17 for 40 tokens, 2 partitions", kFlash, 4);
}

TEST(cache_blocks_larger_and_smaller_than_a_chunk) {
  // Where a group of 8 keys starts inside its cache block: blocks of 128 and 256 keys hold
  // several chunks; blocks of 8 split one chunk over eight; groups past the context.
  check_case<__nv_bfloat16, 64>({64, 4, 2, 128, {70, 0, 45}, {200, 30, 45}}, "blocks of 128");
  check_case<__half, 128>({128, 8, 2, 256, {40, 3}, {300, 3}}, "head 128, blocks of 256");
  check_case<__nv_bfloat16, 80>({80, 2, 1, 128, {30}, {150}}, "head 80, blocks of 128");
  check_case<__half, 256>({256, 4, 2, 32, {20, 5}, {50, 5}}, "head 256, blocks of 32");
  check_case<__nv_bfloat16, 256>({256, 2, 1, 8, {20}, {37}}, "head 256, blocks of 8");
  check_case<__half, 256>({256, 4, 2, 64, {20}, {90}}, "head 256, four warps", Kernel::kFlash, 4);
  check_case<__nv_bfloat16, 128>({128, 4, 1, 64, {1, 1}, {100, 7}}, "decode, blocks of 64");
  // A hint longer than every query: blocks past a request's last tile do nothing.
  Case c{64, 4, 2, 16, {40, 9, 0}, {40, 30, 5}};
  c.max_query_len_hint = 300;
  check_case<__half, 64>(c, "hint 300 for 40 tokens");
}

TEST(split_contexts_of_a_prefill) {
  Case c{64, 4, 2, 16, {20, 3}, {700, 3}};
  c.num_parts = 3;
  check_case<__half, 64>(c, "a chunked prefill over 3 partitions");
  check_case<float, 64>(c, "a chunked prefill over 3 partitions (scalar)", Kernel::kScalar);
}
