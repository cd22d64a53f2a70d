// CPU paged attention and the cache write that feeds it (the CPU half of PagedAttention).
//
// Cache layouts (per block and kv head, one dense tile):
//   key_cache:   [num_blocks, num_kv_heads, head_size, block_size]   keys transposed
//   value_cache: [num_blocks, num_kv_heads, block_size, head_size]
// With keys transposed, a query's block_size scores grow by one vector multiply-add per
// head dimension (no horizontal sums, no transpose at read time); values are read row
// by row into the output accumulator. reshape_and_cache pays the scattered write once
// per token; attention reads each block many times. All query heads of a GQA group
// reuse a tile while it is in cache.
//
// Supported: cache dtypes float32, float16, bfloat16 (query, output and new K/V of the
// same dtype, or on the CPU float32 over a 16-bit cache, which reshape_and_cache rounds
// to nearest; arithmetic in float32); head sizes kSupportedHeadSizes; any block size
// that is a power of two; num_heads a multiple of num_kv_heads (GQA, MQA).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

#include "pyengine/tensor_view.h"

namespace pyengine {

inline constexpr std::array<int, 8> kSupportedHeadSizes = {32, 64, 80, 96, 112, 128, 192, 256};

// Which build of the CPU attention kernel runs: the widest this CPU supports (kAuto), or
// a named one, for tests and benchmarks.
enum class CpuIsa : uint8_t { kAuto, kGeneric, kAvx2, kAvx512 };

// Throws InvalidArgument if this CPU (or this build) cannot run `isa`.
void set_attention_isa(CpuIsa isa);
// The build that runs now (never kAuto).
CpuIsa attention_isa();
bool cpu_supports(CpuIsa isa);

// Writes each new token's key and value into its slot.
//   key, value:      [num_tokens, num_kv_heads, head_size] (last dim dense)
//   key_cache:       [num_blocks, num_kv_heads, head_size, block_size] (dense)
//   value_cache:     [num_blocks, num_kv_heads, block_size, head_size] (dense)
//   slot_mapping:    int64 [num_tokens], block * block_size + offset, or -1 to skip
// Throws InvalidArgument naming the argument, before writing anything. All tensors on
// the CPU, or all on one CUDA device where pyengine was built with CUDA (run on
// `stream`, a cudaStream_t; nullptr: the default stream); there, slots are not read back
// to be checked, and one outside the cache is skipped.
// An int8 cache (its head dims 4 bytes longer, a float32 scale beside each token's
// values) takes each row as round(x / s), s = max|row| / 127, or, with k_scale/v_scale
// > 0, by those static per-tensor scales (a checkpoint's kv_cache_scheme), clamped to
// [-127, 127]. An fp8 cache takes x / k_scale and x / v_scale where they are > 0
// (a checkpoint's fp8 kv_cache_scheme; paged_attention is then given scale * k_scale,
// and its output is times v_scale); other caches take no scales. The 8-bit caches take
// float32 K/V on the CPU, float16 or bfloat16 on CUDA (the same bytes from the same values).
void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping,
                       float k_scale = 0.0f, float v_scale = 0.0f, void* stream = nullptr);

struct AttentionOptions {
  float scale = 1.0f;        // usually 1 / sqrt(head_size)
  int sliding_window = 0;    // > 0: a query at position p sees keys in (p - window, p]
  int attention_chunk = 0;   // > 0: a query at p sees keys in [p - p % chunk, p] (Llama 4's
                             // chunked local attention; with a window too, both bounds)
  float logit_soft_cap = 0;  // > 0: scores become cap * tanh(score / cap)
  // The longest seq_len where the caller knows it (0: unknown, the block tables' reach).
  // The CUDA kernel splits long contexts by it; one too small costs speed, not results.
  int64_t max_seq_len = 0;
  // The most query tokens of any request where the caller knows it (0: unknown, all of
  // them). The CUDA tensor-core kernel sizes its grid by it; one too small costs speed.
  int64_t max_query_len = 0;
  // Each query head's sink logit (gpt-oss's learned sinks), float32 [num_heads] on the
  // tensors' device: a score every query sees that takes a share of the softmax and adds
  // no value (data null: none).
  TensorView sinks;
};

// The first position a query at `position` sees. Blocks wholly before it are never
// read: a KV-cache group of a window may have released them (kNoBlock in the table).
inline int64_t first_visible_position(const AttentionOptions& o, int64_t position) {
  int64_t first = o.sliding_window > 0 ? position - o.sliding_window + 1 : 0;
  if (o.attention_chunk > 0) first = std::max(first, position - position % o.attention_chunk);
  return std::max<int64_t>(first, 0);
}

// Variable-length paged attention: request i's query tokens
// query[query_start_loc[i]:query_start_loc[i + 1]] are the last q_len_i positions of its
// seq_lens[i] tokens, and attend causally to them through block_tables[i].
//   out:             [num_tokens, num_heads, head_size] (written)
//   query:           [num_tokens, num_heads, head_size]
//   key_cache:       [num_blocks, num_kv_heads, head_size, block_size]
//   value_cache:     [num_blocks, num_kv_heads, block_size, head_size]
//   block_tables:    int32 [num_reqs, max_blocks_per_request]
//   seq_lens:        int32 [num_reqs], each >= its q_len
//   query_start_loc: int32 [num_reqs + 1], from 0, ascending, ending at num_tokens; a
//                    request with no query tokens (a sample forked this step) is skipped
// One kernel serves prefill, chunked prefill over a cached prefix, and decode. Throws
// InvalidArgument naming the argument (shapes, dtypes, devices, block ids out of range),
// before writing anything. All tensors on the CPU, or all on one CUDA device where
// pyengine was built with CUDA (run on `stream`, a cudaStream_t; nullptr: the default
// stream); there, the metadata's values are not read back to be checked.
void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables,
                     const TensorView& seq_lens, const TensorView& query_start_loc,
                     const AttentionOptions& options, void* stream = nullptr);

}  // namespace pyengine
