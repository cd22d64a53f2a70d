// The CPU paged-attention kernel's problem description, shared by the glue
// (paged_attention.cpp) and the kernel, which is compiled once per instruction set
// (paged_attention_kernel.inc) and picked at run time. Internal to pyengine_core.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "pyengine/attention.h"

namespace pyengine::detail {

constexpr int kQueryTile = 8;  // query tokens per work item

struct Problem {
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int64_t q_token_stride, q_head_stride;  // elements
  int64_t o_token_stride, o_head_stride;
  int64_t max_blocks;  // block_tables row length
  int64_t num_kv_heads, group, block_size, head_size;
  AttentionOptions options;
};

struct WorkItem {
  int32_t request;
  int32_t kv_head;
  int32_t first_query;  // within the request
  int32_t num_queries;
};

using AttentionKernel = void (*)(const Problem&, const std::vector<WorkItem>&, DType);

// One build of the kernel per instruction set; each exists only where it was compiled.
namespace generic {
void run_attention(const Problem& p, const std::vector<WorkItem>& items, DType dtype);
}
namespace avx2 {
void run_attention(const Problem& p, const std::vector<WorkItem>& items, DType dtype);
}
namespace avx512 {
void run_attention(const Problem& p, const std::vector<WorkItem>& items, DType dtype);
}

}  // namespace pyengine::detail
