// Multi-head latent attention (DeepSeek-V2/V3's MLA) over a paged latent cache, in the
// absorbed form: each token caches one latent vector, [c_kv (value_dim); k_pe (rope)],
// shared by every head; a head's query is its q_nope taken into the latent space by the
// key half of kv_b_proj (q_nope W_UK), then its rotated q_pe. The scores are q . latent,
// the values each key's c_kv, and the output stays in the latent space (the caller takes
// it out by the value half of kv_b_proj). The cache holds value_dim + rope numbers a
// token and layer, where expanded keys and values would hold 2 * heads * head_size.
#pragma once

#include <cstdint>

#include "pyengine/tensor_view.h"

namespace pyengine {

// Request i's query tokens query[query_start_loc[i]:query_start_loc[i + 1]] are the last
// q_len_i positions of its seq_lens[i] tokens, and attend causally to them.
//   out:           [num_tokens, num_heads, value_dim] (written), query's dtype
//   query:         [num_tokens, num_heads, latent_dim], float32 or the cache's dtype
//                  (float32 over an fp8 cache)
//   latent_cache:  [num_blocks, block_size, latent_dim] (dense), float32, float16,
//                  bfloat16 or fp8 e4m3 (its bytes as uint8: vLLM's fp8 cache, no scale)
//   block_tables:  int32 [num_reqs, max_blocks_per_request]
//   seq_lens:      int32 [num_reqs]
//   query_start_loc int32 [num_reqs + 1]
// value_dim (<= latent_dim): the leading dims of each cached vector that are its value.
// On the CPU, or on CUDA (the query and cache of one dtype, value_dim <= 512, latent_dim
// <= 1024; no fp8 cache; `stream` a cudaStream_t, nullptr: the default stream). Throws
// InvalidArgument naming the argument, before writing anything.
void mla_attention(const TensorView& out, const TensorView& query, const TensorView& latent_cache,
                   const TensorView& block_tables, const TensorView& seq_lens,
                   const TensorView& query_start_loc, float scale, int64_t value_dim,
                   void* stream = nullptr);

// The build of mla_attention that runs a bfloat16 query over a bfloat16 cache of these
// shapes on this CPU: "amx" (the tile unit), "avx512_bf16" (AVX512-BF16's dot products)
// or "portable" (the loops built per instruction set, which every other dtype takes).
// Which form a prefill takes follows it (layers/latent_attention.py).
const char* mla_attention_bf16_build(int64_t num_heads, int64_t latent_dim, int64_t value_dim,
                                     int64_t block_size);

}  // namespace pyengine
