// CUDA multi-head latent attention (see mla_attention_launch.h): the kernel of
// mla_attention.cuh over the token's context, split into partitions where few tokens
// have long contexts, then the scalar paged-attention kernel's merge.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "cuda/attention_params.cuh"
#include "cuda/element_types.cuh"
#include "cuda/mla_attention.cuh"
#include "cuda/mla_attention_launch.h"
#include "cuda/paged_attention.cuh"
#include "cuda/runtime_guards.h"

namespace pyengine::cuda {

void mla_attention(const TensorView& out, const TensorView& query, const TensorView& latent_cache,
                   const TensorView& block_tables, const TensorView& seq_lens,
                   const TensorView& query_start_loc, float scale, int64_t value_dim,
                   void* stream) {
  const int64_t num_tokens = query.shape[0];
  if (num_tokens == 0) return;
  AttentionParams p{};
  p.query = query.data;
  p.key_cache = latent_cache.data;
  p.block_tables = static_cast<const int32_t*>(block_tables.data);
  p.seq_lens = static_cast<const int32_t*>(seq_lens.data);
  p.query_start_loc = static_cast<const int32_t*>(query_start_loc.data);
  p.out = out.data;
  p.q_token_stride = query.strides[0];
  p.q_head_stride = query.strides[1];
  p.o_token_stride = out.strides[0];
  p.o_head_stride = out.strides[1];
  p.max_blocks = block_tables.shape[1];
  p.num_blocks = latent_cache.shape[0];
  p.num_reqs = static_cast<int>(seq_lens.shape[0]);
  p.num_heads = static_cast<int>(query.shape[1]);
  p.num_kv_heads = 1;
  p.head_size = static_cast<int>(value_dim);  // (the merge's: the value's dims)
  p.block_size = static_cast<int>(latent_cache.shape[1]);
  p.scale = scale;
  const int latent_dim = static_cast<int>(latent_cache.shape[2]);
  const int64_t reach = p.max_blocks * p.block_size;  // the longest context's bound
  const bool split =
      num_tokens * p.num_heads < mla::kSplitBelowPairs && reach > mla::kPartitionKeys;
  p.num_parts = split ? static_cast<int>(std::min<int64_t>(
                            (reach + mla::kPartitionKeys - 1) / mla::kPartitionKeys,
                            mla::kMaxPartitions))
                      : 1;

  const DeviceGuard guard(query.device.index);
  const auto s = static_cast<cudaStream_t>(stream);
  std::optional<StreamBuffer> partials;  // only where contexts are split
  if (split) {
    const auto bytes =
        static_cast<size_t>(num_tokens * p.num_heads * p.num_parts * (value_dim + 2)) *
        sizeof(float);
    partials.emplace("mla_attention", bytes, s);
    p.partials = reinterpret_cast<float*>(partials->data());
  }
  const dim3 grid(static_cast<unsigned>(num_tokens), static_cast<unsigned>(p.num_heads),
                  static_cast<unsigned>(p.num_parts));
  for_dtype(query.dtype, "mla_attention", [&](auto zero) {
    using T = decltype(zero);
    mla::mla_kernel<T><<<grid, mla::kThreads, 0, s>>>(p, latent_dim);
    check_cuda("mla_attention", cudaGetLastError(), "kernel launch");
    if (split) {
      const dim3 merged(static_cast<unsigned>(num_tokens), static_cast<unsigned>(p.num_heads));
      scalar_attention::merge_kernel<T><<<merged, scalar_attention::kThreads, 0, s>>>(p);
      check_cuda("mla_attention", cudaGetLastError(), "merge kernel launch");
    }
  });
}

}  // namespace pyengine::cuda
