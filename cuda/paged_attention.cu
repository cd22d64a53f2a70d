// CUDA paged attention (see paged_attention_launch.h): the dispatch. float16 and bfloat16 of the
// common head sizes run on tensor cores (flash_attention.cuh); everything else (float32,
// other head sizes, 8-bit caches) on the scalar kernel (paged_attention.cuh), whose merge
// kernel also merges the tensor-core kernel's split contexts.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>

#include "cuda/attention_params.cuh"
#include "cuda/cache_8bit.cuh"
#include "cuda/element_types.cuh"
#include "cuda/flash_attention_launch.h"
#include "cuda/paged_attention.cuh"
#include "cuda/paged_attention_launch.h"
#include "cuda/runtime_guards.h"

namespace pyengine::cuda {
namespace {

using scalar_attention::attention_kernel;
using scalar_attention::kMaxPartitions;
using scalar_attention::kPartitionKeys;
using scalar_attention::kSplitBelowPairs;
using scalar_attention::kThreads;
using scalar_attention::merge_kernel;
using Params = AttentionParams;

template <typename T, typename C, int kDimsPerLane>
void launch(const Params& p, int64_t num_tokens, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(num_tokens), static_cast<unsigned>(p.num_heads),
                  static_cast<unsigned>(p.num_parts));
  attention_kernel<T, C, kDimsPerLane><<<grid, kThreads, 0, stream>>>(p);
  check_cuda("paged_attention", cudaGetLastError(), "kernel launch");
}

template <typename T>
void merge(const Params& p, int64_t num_tokens, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(num_tokens), static_cast<unsigned>(p.num_heads));
  merge_kernel<T><<<grid, kThreads, 0, stream>>>(p);
  check_cuda("paged_attention", cudaGetLastError(), "merge kernel launch");
}

bool aligned(const void* data, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(data) % bytes == 0;
}

// Whether the tensor-core kernel takes this call: its shapes, and alignment for its
// 16-byte cache loads and 4-byte query and output accesses.
bool use_flash(const Params& p, const TensorView& query, const TensorView& key_cache,
               const TensorView& out) {
  return !is_8bit_cache(key_cache.dtype) &&
         flash_attention_supports(query.dtype, p.head_size, p.block_size,
                                  p.num_heads / p.num_kv_heads) &&
         aligned(p.key_cache, 16) && aligned(p.value_cache, 16) && aligned(query.data, 4) &&
         aligned(out.data, 4) && p.q_token_stride % 2 == 0 && p.q_head_stride % 2 == 0 &&
         p.o_token_stride % 2 == 0 && p.o_head_stride % 2 == 0;
}

// launch<T, C, lanes>() with the head dimension spread over 32 lanes: ceil(head_size / 32)
// dims each (the glue admits 32, 64, 80, 96, 112, 128, 192 and 256).
template <typename T, typename C>
void launch_for_head_size(const Params& p, int64_t num_tokens, cudaStream_t stream) {
  switch ((p.head_size + kWarp - 1) / kWarp) {
    case 1: return launch<T, C, 1>(p, num_tokens, stream);
    case 2: return launch<T, C, 2>(p, num_tokens, stream);
    case 3: return launch<T, C, 3>(p, num_tokens, stream);
    case 4: return launch<T, C, 4>(p, num_tokens, stream);
    case 6: return launch<T, C, 6>(p, num_tokens, stream);
    case 8: return launch<T, C, 8>(p, num_tokens, stream);
    default: throw std::invalid_argument("paged_attention (CUDA): unsupported head size");
  }
}

}  // namespace

void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables,
                     const TensorView& seq_lens, const TensorView& query_start_loc,
                     const AttentionOptions& options, void* stream) {
  const int64_t num_tokens = query.shape[0];
  if (num_tokens == 0) return;
  Params p{};
  p.query = query.data;
  p.key_cache = key_cache.data;
  p.value_cache = value_cache.data;
  p.block_tables = static_cast<const int32_t*>(block_tables.data);
  p.seq_lens = static_cast<const int32_t*>(seq_lens.data);
  p.query_start_loc = static_cast<const int32_t*>(query_start_loc.data);
  p.out = out.data;
  p.q_token_stride = query.strides[0];
  p.q_head_stride = query.strides[1];
  p.o_token_stride = out.strides[0];
  p.o_head_stride = out.strides[1];
  p.max_blocks = block_tables.shape[1];
  p.num_blocks = key_cache.shape[0];
  p.num_reqs = static_cast<int>(seq_lens.shape[0]);
  p.num_heads = static_cast<int>(query.shape[1]);
  p.num_kv_heads = static_cast<int>(key_cache.shape[1]);
  p.head_size = static_cast<int>(value_cache.shape[3]) -
                (value_cache.dtype == DType::kInt8 ? kInt8ScaleBytes : 0);
  p.block_size = static_cast<int>(key_cache.shape[3]);
  p.scale = options.scale;
  p.sliding_window = options.sliding_window;
  p.attention_chunk = options.attention_chunk;
  p.logit_soft_cap = options.logit_soft_cap;
  p.sinks = static_cast<const float*>(options.sinks.data);
  // The longest context: the caller's hint, else any request's block table's reach.
  const int64_t reach = p.max_blocks * p.block_size;
  const int64_t max_context =
      options.max_seq_len > 0 ? std::min(options.max_seq_len, reach) : reach;
  const bool split = num_tokens * p.num_heads < kSplitBelowPairs && max_context > kPartitionKeys;
  p.num_parts = split ? static_cast<int>(std::min<int64_t>(
                            (max_context + kPartitionKeys - 1) / kPartitionKeys, kMaxPartitions))
                      : 1;

  const DeviceGuard guard(query.device.index);
  const auto s = static_cast<cudaStream_t>(stream);
  const size_t partial_bytes =
      split ? static_cast<size_t>(num_tokens * p.num_heads * p.num_parts * (p.head_size + 2)) *
                  sizeof(float)
            : 0;
  std::optional<StreamBuffer> partials;  // only where contexts are split
  if (split) {
    partials.emplace("paged_attention", partial_bytes, s);
    p.partials = reinterpret_cast<float*>(partials->data());
  }
  if (use_flash(p, query, key_cache, out)) {
    const int64_t max_query =
        options.max_query_len > 0 ? std::min(options.max_query_len, num_tokens) : num_tokens;
    flash_attention(p, query.dtype, max_query, s);
  } else if (is_8bit_cache(key_cache.dtype)) {
    for_16bit_dtype(query.dtype, "paged_attention", [&](auto zero) {
      for_8bit_cache(key_cache.dtype, "paged_attention", [&](auto element) {
        launch_for_head_size<decltype(zero), decltype(element)>(p, num_tokens, s);
      });
    });
  } else {
    for_dtype(query.dtype, "paged_attention", [&](auto zero) {
      using T = decltype(zero);
      launch_for_head_size<T, T>(p, num_tokens, s);
    });
  }
  if (split) {
    for_dtype(query.dtype, "paged_attention",
              [&](auto zero) { merge<decltype(zero)>(p, num_tokens, s); });
  }
}

}  // namespace pyengine::cuda
