// Host-side launcher of the tensor-core paged-attention kernel (flash_attention.cu), for
// the dispatch in paged_attention.cu. Internal to cuda/.
#pragma once

#include <cuda_runtime.h>

#include "cuda/attention_params.cuh"
#include "pyengine/tensor_view.h"

namespace pyengine::cuda {

// Whether the tensor-core kernel takes these shapes: float16 or bfloat16, head sizes 64,
// 80, 96, 128 and 256, blocks of a power of two (at least 8) tokens, and at most 64 query
// heads per kv head.
bool flash_attention_supports(DType dtype, int head_size, int block_size, int group_size);

// Launches it (p.tiles_per_request is set here, from max_query_len: the most query tokens
// of any request, or an underestimate, which costs speed only): writes `out`, or the
// partials where p.num_parts > 1 (merged by the caller).
void flash_attention(AttentionParams p, DType dtype, int64_t max_query_len, cudaStream_t stream);

}  // namespace pyengine::cuda
