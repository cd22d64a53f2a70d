// CPU paged attention, the glue: checks every argument, plans the work (tiles of request
// x kv head x up to kQueryTile query tokens; with too few tiles for the threads, long
// contexts split into parts merged afterwards) and runs the kernel build for this CPU
// (paged_attention_kernel.inc: online softmax over the request's KV blocks, one block at
// a time, for a tile of query tokens times the query heads of one kv head's GQA group;
// K/V are read once per tile, and no score matrix beyond one block is ever held).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kv_cache_checks.h"
#include "paged_attention_kernel.h"
#include "pyengine/attention.h"
#include "tensor_checks.h"
#ifdef PYENGINE_WITH_CUDA
#include "cuda/paged_attention_launch.h"
#endif

namespace pyengine {
namespace {

using detail::arg;
using detail::AttentionParams;
using detail::kQueryTile;
using detail::SplitTile;
using detail::Tile;
using detail::WorkItem;

bool supported(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAuto:
    case CpuIsa::kGeneric: return true;
#ifdef PYENGINE_X86_KERNELS
    case CpuIsa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case CpuIsa::kAvx512: return __builtin_cpu_supports("avx512f");
#else
    case CpuIsa::kAvx2:
    case CpuIsa::kAvx512: return false;
#endif
  }
  return false;
}

CpuIsa widest() {
  if (supported(CpuIsa::kAvx512)) return CpuIsa::kAvx512;
  if (supported(CpuIsa::kAvx2)) return CpuIsa::kAvx2;
  return CpuIsa::kGeneric;
}

// The build in use; a test or benchmark may pin another (set_attention_isa).
std::atomic<CpuIsa>& current_isa() {
  static std::atomic<CpuIsa> isa{widest()};
  return isa;
}

detail::AttentionKernel kernel_for(CpuIsa isa) {
#ifdef PYENGINE_X86_KERNELS
  if (isa == CpuIsa::kAvx512) return detail::avx512::run_attention;
  if (isa == CpuIsa::kAvx2) return detail::avx2::run_attention;
#endif
  (void)isa;
  return detail::generic::run_attention;
}

// Split-K: a tile whose context is split runs as parts of at least this many tokens. (A
// single request's decode has as many tiles as kv heads, three for the default model: at
// 256 its contexts of a few hundred tokens stayed whole, two threads taking them 2:1.)
constexpr int64_t kMinSplitTokens = 64;

int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// The work of one call, kept per calling thread and reused so that a call does not
// allocate once the buffers have grown.
struct WorkPlan {
  std::vector<Tile> tiles;
  std::vector<WorkItem> items;
  std::vector<SplitTile> splits;
  std::vector<float> partials;
  int64_t num_partials = 0;
};

// Tiles of (request, kv head, up to kQueryTile query tokens), each over the key blocks its
// queries can see. When there are too few tiles to keep every thread busy (decode of a
// few requests), long contexts are split into parts whose partial results are merged.
WorkPlan& plan_work(const int32_t* qsl, const int32_t* lens, int64_t num_reqs, int64_t num_kv_heads,
                    int64_t block_size, const AttentionOptions& options) {
  thread_local WorkPlan plan;
  plan.tiles.clear();
  plan.items.clear();
  plan.splits.clear();
  plan.num_partials = 0;
  for (int64_t i = 0; i < num_reqs; ++i) {
    const int64_t q_len = qsl[i + 1] - qsl[i];
    for (int64_t first = 0; first < q_len; first += kQueryTile) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        plan.tiles.push_back({static_cast<int32_t>(i), static_cast<int32_t>(h),
                              static_cast<int32_t>(first),
                              static_cast<int32_t>(std::min<int64_t>(kQueryTile, q_len - first))});
      }
    }
  }
  const int64_t threads = max_threads();
  const auto num_tiles = static_cast<int64_t>(plan.tiles.size());
  // (No tiles: no query tokens, nothing to split.)
  const int64_t wanted_parts = threads > 1 && 0 < num_tiles && num_tiles < 2 * threads
                                   ? (4 * threads + num_tiles - 1) / num_tiles
                                   : 1;
  const int64_t min_part_blocks = std::max<int64_t>(1, kMinSplitTokens / block_size);
  for (const Tile& t : plan.tiles) {
    const int64_t first_pos =
        lens[t.request] - (qsl[t.request + 1] - qsl[t.request]) + t.first_query;
    const int64_t last_pos = first_pos + t.num_queries - 1;
    const int64_t begin = first_visible_position(options, first_pos) / block_size;
    const int64_t end = last_pos / block_size + 1;
    const int64_t parts = std::clamp<int64_t>((end - begin) / min_part_blocks, 1, wanted_parts);
    if (parts == 1) {
      plan.items.push_back({t, static_cast<int32_t>(begin), static_cast<int32_t>(end), -1});
      continue;
    }
    plan.splits.push_back(
        {t, static_cast<int32_t>(plan.num_partials), static_cast<int32_t>(parts)});
    for (int64_t k = 0; k < parts; ++k) {
      plan.items.push_back({t, static_cast<int32_t>(begin + (end - begin) * k / parts),
                            static_cast<int32_t>(begin + (end - begin) * (k + 1) / parts),
                            static_cast<int32_t>(plan.num_partials++)});
    }
  }
  return plan;
}

}  // namespace

bool cpu_supports(CpuIsa isa) { return supported(isa); }

void set_attention_isa(CpuIsa isa) {
  check_argument(supported(isa), "set_attention_isa: this CPU or build cannot run that kernel");
  current_isa().store(isa == CpuIsa::kAuto ? widest() : isa);
}

CpuIsa attention_isa() { return current_isa().load(); }

void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables,
                     const TensorView& seq_lens, const TensorView& query_start_loc,
                     const AttentionOptions& options, void* stream) {
  constexpr const char* op = "paged_attention";
  const Device& device = key_cache.device;
  const auto [num_blocks, num_kv_heads, block_size, head_size] =
      detail::check_caches(key_cache, value_cache, op, &device);
  if (std::find(kSupportedHeadSizes.begin(), kSupportedHeadSizes.end(), head_size) ==
      kSupportedHeadSizes.end()) {
    std::string sizes;
    for (const int size : kSupportedHeadSizes)
      sizes += (sizes.empty() ? "" : ", ") + std::to_string(size);
    throw InvalidArgument(std::string(op) + ": head_size " + std::to_string(head_size) +
                          " is not supported (" + sizes + ")");
  }
  const DType query_dtype = detail::input_dtype_for(query, key_cache, op, "query");
  for (const auto& [t, name] : {std::pair{&query, "query"}, std::pair{&out, "out"}}) {
    detail::check_device(*t, device, op, name);
    detail::check_shape(*t, op, name, 3);
    detail::check_dtype(*t, query_dtype, op, name);
    if (t->shape[2] != head_size || t->strides[2] != 1) {
      throw InvalidArgument(arg(op, name) + " must be [num_tokens, num_heads, " +
                            std::to_string(head_size) + "] with a dense last dim, got " +
                            t->describe());
    }
  }
  detail::check_writable(out, op, "out");
  if (out.shape[0] != query.shape[0] || out.shape[1] != query.shape[1]) {
    throw InvalidArgument(std::string(op) + ": out " + out.describe() + " differs from query " +
                          query.describe());
  }
  const int64_t num_tokens = query.shape[0];
  const int64_t num_heads = query.shape[1];
  if (num_heads % num_kv_heads != 0) {
    throw InvalidArgument(std::string(op) + ": num_heads (" + std::to_string(num_heads) +
                          ") must be a multiple of num_kv_heads (" + std::to_string(num_kv_heads) +
                          ")");
  }
  const int64_t num_reqs =
      detail::check_request_arrays(block_tables, seq_lens, query_start_loc, device, op);
  if (!std::isfinite(options.scale) || options.sliding_window < 0 ||
      options.attention_chunk < 0 || !(options.logit_soft_cap >= 0) ||
      !std::isfinite(options.logit_soft_cap)) {
    throw InvalidArgument(std::string(op) +
                          ": scale must be finite, sliding_window and attention_chunk >= 0 and "
                          "logit_soft_cap finite and >= 0");
  }
  if (options.sinks.data != nullptr) {
    const TensorView& sinks = options.sinks;
    detail::check_device(sinks, device, op, "sinks");
    if (sinks.ndim != 1 || sinks.dtype != DType::kFloat32 || sinks.shape[0] != num_heads ||
        (num_heads > 1 && sinks.strides[0] != 1)) {
      throw InvalidArgument(arg(op, "sinks") + " must be dense float32 [" +
                            std::to_string(num_heads) + "] (num_heads), got " + sinks.describe());
    }
  }
  // The metadata stay on the device: see cuda/paged_attention_launch.h.
  if (detail::on_cuda(device, op)) {
#ifdef PYENGINE_WITH_CUDA
    return cuda::paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                                 query_start_loc, options, stream);
#endif
  }
  (void)stream;
  const auto* qsl = static_cast<const int32_t*>(query_start_loc.data);
  const auto* lens = static_cast<const int32_t*>(seq_lens.data);
  const auto* tables = static_cast<const int32_t*>(block_tables.data);
  const int64_t max_blocks = block_tables.shape[1];
  // (blocks before a request's first query's first visible position are never read)
  detail::check_request_values(block_tables, seq_lens, query_start_loc, num_tokens, block_size,
                               num_blocks, op, [&](int64_t first_position) {
                                 return first_visible_position(options, first_position) /
                                        block_size;
                               });
  const int64_t group = num_heads / num_kv_heads;

  WorkPlan& plan = plan_work(qsl, lens, num_reqs, num_kv_heads, block_size, options);
  const int64_t partial_stride = kQueryTile * group * (head_size + 2);
  const auto partial_floats = static_cast<size_t>(plan.num_partials * partial_stride);
  if (plan.partials.size() < partial_floats) plan.partials.resize(partial_floats);

  const AttentionParams p{out.data,
                          query.data,
                          key_cache.data,
                          value_cache.data,
                          tables,
                          lens,
                          qsl,
                          query.strides[0],
                          query.strides[1],
                          out.strides[0],
                          out.strides[1],
                          max_blocks,
                          num_kv_heads,
                          group,
                          block_size,
                          head_size,
                          options,
                          plan.partials.data(),
                          partial_stride};
  kernel_for(current_isa().load(std::memory_order_relaxed))(p, plan.items, plan.splits, query.dtype,
                                                            key_cache.dtype);
}

}  // namespace pyengine
