// Host-side launcher of the tensor-core paged-attention kernel (flash_attention.cu), for
// the dispatch in paged_attention.cu. Internal to cuda/.
#pragma once

#include <cuda_runtime.h>

#include "attention_params.cuh"
#include "pyengine/tensor_view.h"

namespace pyengine::cuda {

// Query rows (token, query head of one kv head's group) per thread block.
constexpr int kFlashTileRows = 64;

// Whether the tensor-core kernel takes these shapes: float16 or bfloat16, head sizes 64,
// 80, 96, 128 and 256, blocks of a multiple of 8 tokens, and at most kFlashTileRows query
// heads per kv head.
bool flash_attention_supports(DType dtype, int head_size, int block_size, int group_size);

// Launches it over grid (num_reqs * p.tiles_per_request, num_kv_heads, num_parts): writes
// `out`, or the partials where p.num_parts > 1 (merged by the caller).
void flash_attention(const AttentionParams& p, DType dtype, cudaStream_t stream);

}  // namespace pyengine::cuda
