// MLA attention on the CPU: a work item is one query token (or, for few tokens, a part
// of its context) with every head at once, so that each cached latent vector is read and
// widened once for all heads (the heads share it, as in multi-query attention). Keys go
// a cache block at a time: the block's rows widened to float, every head's scores, then
// one online-softmax step per head and block. Parts of a split context merge after.
#include "pyengine/mla.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "float_convert.h"
#include "kv_cache_checks.h"
#include "mla_lanes.h"
#include "mla_kernel.h"
#include "pyengine/attention.h"
#include "pyengine/errors.h"
#include "tensor_checks.h"
#ifdef PYENGINE_WITH_CUDA
#include "cuda/mla_attention_launch.h"
#endif

namespace pyengine {
namespace {

constexpr const char* kOp = "mla_attention";
// The CUDA kernel's bounds (cuda/mla_attention.cuh: kMaxValue, kMaxLatent).
constexpr int64_t kCudaMaxValue = 512, kCudaMaxLatent = 1024;
constexpr int64_t kMinPartKeys = 256;  // a split part's fewest keys

void narrow(const float* in, DType dtype, int64_t n, void* row) {
  if (dtype == DType::kFloat32) {
    std::copy_n(in, n, static_cast<float*>(row));
    return;
  }
  auto* h = static_cast<uint16_t*>(row);
  for (int64_t i = 0; i < n; ++i) {
    h[i] = dtype == DType::kBFloat16 ? detail::float_to_bf16(in[i]) : detail::float_to_fp16(in[i]);
  }
}

// The portable kernel's build for the CPU in use (a test may pin one: set_attention_isa).
detail::MlaAttend attend_for(CpuIsa isa) {
#ifdef PYENGINE_X86_KERNELS
  if (isa == CpuIsa::kAvx512) return detail::avx512::mla_attend;
  if (isa == CpuIsa::kAvx2) return detail::avx2::mla_attend;
#endif
  (void)isa;
  return detail::generic::mla_attend;
}

}  // namespace

namespace {

// The build that runs a bfloat16 query over a bfloat16 cache of these shapes here.
enum class LaneBuild : uint8_t { kPortable, kAmx, kDots };

LaneBuild lane_build(const detail::MlaTile& tile) {
  if (detail::mla_amx_fits(tile)) return LaneBuild::kAmx;
  if (detail::mla_bf16_fits(tile)) return LaneBuild::kDots;
  return LaneBuild::kPortable;
}

// A call's tile: the lane builds take up to 16 heads at a time (more go 16 at a time).
detail::MlaTile lane_tile(int64_t heads, int64_t latent_dim, int64_t value_dim,
                          int64_t block_size) {
  return {std::min<int64_t>(heads, 16), latent_dim, value_dim, block_size};
}

}  // namespace

const char* mla_attention_bf16_build(int64_t num_heads, int64_t latent_dim, int64_t value_dim,
                                     int64_t block_size) {
  switch (lane_build(lane_tile(num_heads, latent_dim, value_dim, block_size))) {
    case LaneBuild::kAmx:
      return "amx";
    case LaneBuild::kDots:
      return "avx512_bf16";
    case LaneBuild::kPortable:
      break;
  }
  return "portable";
}

void mla_attention(const TensorView& out, const TensorView& query, const TensorView& latent_cache,
                   const TensorView& block_tables, const TensorView& seq_lens,
                   const TensorView& query_start_loc, float scale, int64_t value_dim,
                   void* stream) {
  const Device& device = latent_cache.device;
  detail::check_shape(latent_cache, kOp, "latent_cache", 3);
  const DType cache_dtype = latent_cache.dtype;
  const bool fp8 = cache_dtype == detail::kFp8Cache;  // (e4m3 bytes as uint8)
  if (cache_dtype != DType::kFloat32 && cache_dtype != DType::kBFloat16 &&
      cache_dtype != DType::kFloat16 && !fp8) {
    throw InvalidArgument(detail::arg(kOp, "latent_cache") +
                          " must be float32, float16, bfloat16 or fp8 e4m3 (uint8), got " +
                          latent_cache.describe());
  }
  const int64_t num_blocks = latent_cache.shape[0], bs = latent_cache.shape[1];
  const int64_t d = latent_cache.shape[2];
  if (latent_cache.strides[2] != 1 || latent_cache.strides[1] != d ||
      latent_cache.strides[0] != bs * d) {
    throw InvalidArgument(detail::arg(kOp, "latent_cache") + " must be dense, got " +
                          latent_cache.describe());
  }
  const DType qdtype = query.dtype;
  if (qdtype != DType::kFloat32 && (qdtype != cache_dtype || fp8)) {
    throw InvalidArgument(detail::arg(kOp, "query") +
                          " must be float32 or the cache's dtype (float32 over an fp8 cache), " +
                          "got " + query.describe());
  }
  detail::check_rows_on(query, device, kOp, "query", 3, qdtype);
  detail::check_rows_on(out, device, kOp, "out", 3, qdtype);
  detail::check_writable(out, kOp, "out");
  const int64_t num_tokens = query.shape[0], heads = query.shape[1];
  if (query.shape[2] != d) {
    throw InvalidArgument(std::string(kOp) + ": query's last dim must be the latent's (" +
                          std::to_string(d) + "), got " + query.describe());
  }
  if (!(value_dim >= 1 && value_dim <= d)) {
    throw InvalidArgument(std::string(kOp) + ": value_dim must be in [1, " + std::to_string(d) +
                          "], got " + std::to_string(value_dim));
  }
  if (out.shape[0] != num_tokens || out.shape[1] != heads || out.shape[2] != value_dim) {
    throw InvalidArgument(std::string(kOp) + ": out must be [num_tokens, num_heads, value_dim], " +
                          "got " + out.describe());
  }
  if (!std::isfinite(scale)) throw InvalidArgument(std::string(kOp) + ": scale must be finite");
  const int64_t num_reqs =
      detail::check_request_arrays(block_tables, seq_lens, query_start_loc, device, kOp);
  // The metadata stay on the device: see cuda/mla_attention_launch.h.
  if (detail::on_cuda(device, kOp)) {
    if (fp8 || qdtype != cache_dtype || value_dim > kCudaMaxValue || d > kCudaMaxLatent) {
      throw InvalidArgument(std::string(kOp) + " (CUDA): the query and cache of one dtype " +
                            "(float32, float16 or bfloat16), value_dim <= " +
                            std::to_string(kCudaMaxValue) + " and a latent of at most " +
                            std::to_string(kCudaMaxLatent) + ", got query " + query.describe() +
                            ", latent_cache " + latent_cache.describe() + ", value_dim " +
                            std::to_string(value_dim));
    }
#ifdef PYENGINE_WITH_CUDA
    return cuda::mla_attention(out, query, latent_cache, block_tables, seq_lens, query_start_loc,
                               scale, value_dim, stream);
#endif
  }
  (void)stream;
  detail::check_request_values(block_tables, seq_lens, query_start_loc, num_tokens, bs,
                               num_blocks, kOp, [](int64_t) { return int64_t{0}; });
  const int64_t max_blocks = block_tables.shape[1];
  const auto* qsl = static_cast<const int32_t*>(query_start_loc.data);
  const auto* lens = static_cast<const int32_t*>(seq_lens.data);
  const auto* tables = static_cast<const int32_t*>(block_tables.data);

  // The items: a token each, or, while there are fewer tokens than threads to keep busy,
  // parts of each token's context of at least kMinPartKeys keys.
  const int64_t threads = omp_get_max_threads();
  std::vector<detail::MlaItem> items;
  std::vector<std::pair<int64_t, int64_t>> splits;  // (token, its first partial), split ones
  int64_t num_partials = 0;
  for (int64_t i = 0; i < num_reqs; ++i) {
    const int64_t q_len = qsl[i + 1] - qsl[i];
    for (int64_t j = 0; j < q_len; ++j) {
      const int64_t token = qsl[i] + j, position = lens[i] - q_len + j, keys = position + 1;
      const int64_t wanted = num_tokens < 2 * threads ? (2 * threads + num_tokens - 1) / num_tokens : 1;
      const int64_t parts = std::clamp<int64_t>(keys / kMinPartKeys, 1, wanted);
      if (parts == 1) {
        items.push_back({token, position, i, 0, keys, -1});
        continue;
      }
      splits.emplace_back(token, num_partials);
      for (int64_t k = 0; k < parts; ++k) {
        items.push_back({token, position, i, keys * k / parts, keys * (k + 1) / parts,
                         num_partials++});
      }
    }
  }
  const detail::MlaShapes s{heads, d, value_dim, bs, max_blocks};
  const detail::MlaAttend attend = attend_for(attention_isa());
  const int64_t partial_floats = heads * (value_dim + 2);
  std::vector<float> partials(static_cast<size_t>(num_partials * partial_floats));
  const int64_t qelem = qdtype == DType::kFloat32 ? 4 : 2;
  // bfloat16 queries over a bfloat16 cache: on AMX's tile unit where the shapes fit, else
  // on AVX512-BF16's dot products where the CPU has them.
  const detail::MlaTile tile = lane_tile(heads, d, value_dim, bs);
  const bool bf16 = qdtype == DType::kBFloat16 && cache_dtype == DType::kBFloat16;
  const LaneBuild build = bf16 ? lane_build(tile) : LaneBuild::kPortable;
  const bool on_tiles = build == LaneBuild::kAmx, on_dots = build == LaneBuild::kDots;
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t n = 0; n < items.size(); ++n) {
    const detail::MlaItem& w = items[n];
    thread_local std::vector<float> q, acc, max, sum;
    acc.resize(static_cast<size_t>(heads * value_dim));
    max.resize(static_cast<size_t>(heads));
    sum.resize(static_cast<size_t>(heads));
    const int32_t* table = tables + w.request * max_blocks;
    if (on_tiles || on_dots) {
      const auto* qrow = static_cast<const uint16_t*>(query.data) + w.token * query.strides[0];
      const auto* rows = static_cast<const uint16_t*>(latent_cache.data);
      const auto attend = on_tiles ? detail::attend_amx : detail::attend_bf16;
      std::optional<detail::AmxTiles> tiles;
      if (on_tiles) tiles.emplace();
      // 16 heads at a time (the latents read again for each 16, from the caches mostly)
      for (int64_t g = 0; g < heads; g += 16) {
        detail::MlaTile group = tile;
        group.heads = std::min<int64_t>(16, heads - g);
        attend(group, qrow + g * d, rows, table, w.begin, w.end, scale,
               acc.data() + g * value_dim, max.data() + g, sum.data() + g);
      }
    } else {
      q.resize(static_cast<size_t>(heads * d));
      for (int64_t h = 0; h < heads; ++h) {
        const auto* row = static_cast<const char*>(query.data) +
                          (w.token * query.strides[0] + h * query.strides[1]) * qelem;
        detail::generic::mla_widen(row, qdtype, d, q.data() + h * d);
      }
      attend(w, s, q.data(), latent_cache.data, cache_dtype, table, scale, acc.data(), max.data(),
             sum.data());
    }
    if (w.partial >= 0) {
      float* part = partials.data() + w.partial * partial_floats;
      std::copy(max.begin(), max.end(), part);
      std::copy(sum.begin(), sum.end(), part + heads);
      std::copy(acc.begin(), acc.end(), part + 2 * heads);
      continue;
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* a = acc.data() + h * value_dim;
      const float inverse = 1.0f / sum[static_cast<size_t>(h)];
      for (int64_t i = 0; i < value_dim; ++i) a[i] *= inverse;
      auto* row = static_cast<char*>(out.data) + (w.token * out.strides[0] + h * out.strides[1]) * qelem;
      narrow(a, qdtype, value_dim, row);
    }
  }
  // The split tokens: their parts' results merged (log-sum-exp over the parts).
  for (size_t n = 0; n < splits.size(); ++n) {
    const auto [token, first] = splits[n];
    const int64_t parts = (n + 1 < splits.size() ? splits[n + 1].second : num_partials) - first;
    std::vector<float> merged(static_cast<size_t>(value_dim));
    for (int64_t h = 0; h < heads; ++h) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t k = 0; k < parts; ++k) top = std::max(top, partials[(first + k) * partial_floats + h]);
      float total = 0.0f;
      std::fill(merged.begin(), merged.end(), 0.0f);
      for (int64_t k = 0; k < parts; ++k) {
        const float* part = partials.data() + (first + k) * partial_floats;
        const float weight = std::exp(part[h] - top);
        total += part[heads + h] * weight;
        const float* a = part + 2 * heads + h * value_dim;
        for (int64_t i = 0; i < value_dim; ++i) merged[i] += a[i] * weight;
      }
      for (float& x : merged) x /= total;
      auto* row = static_cast<char*>(out.data) + (token * out.strides[0] + h * out.strides[1]) * qelem;
      narrow(merged.data(), qdtype, value_dim, row);
    }
  }
}

}  // namespace pyengine
