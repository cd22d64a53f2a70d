// The CUDA GEMM over block-quantized weights (cuda/block_gemm.cuh): out [m, n] = x [m, k]
// @ w^T + bias with w [n, k] = q * scale + offset, a scale and offset per group of k (32,
// or 16 at 8 bits: Q6_K's), q 4-bit (0..15) or 8-bit (int8): GGUF's blocks and the
// integer checkpoints in that form, multiplied on tensor cores from 0.5 or 1 byte a
// weight. x and out float16 or bfloat16 on one CUDA device, each weight widened exactly
// as a dequantization to that type at load would (q * scale + offset in float32, rounded
// once), float32 sums.
#pragma once

#include <cstdint>

#include "pyengine/tensor_view.h"

namespace pyengine {

// Bytes of a [n, k] weight's integers in block_gemm's order (k a multiple of 32; n
// rounded up to 8 columns).
int64_t packed_block_gemm_size(int64_t k, int64_t n, int bits);

// Reorders q [n, k] (CPU; uint8 0..15 for 4 bits, int8 for 8) into `packed` (CPU uint8
// [packed_block_gemm_size(k, n, bits)]): a warp's B operands as consecutive words.
void pack_block_gemm_weight(const TensorView& packed, const TensorView& q, int bits);

// out [m, n] = x [m, k] @ w^T (+ bias float32 [n]; bias.data null: none). packed: from
// pack_block_gemm_weight, copied to the device; scale, offset float32 [n, k / group],
// group 32 or (8 bits) 16. On `stream` (a cudaStream_t) of the tensors' CUDA device;
// InvalidArgument for tensors on the CPU (whose blocks dense multiplies) or without CUDA.
void block_gemm(const TensorView& out, const TensorView& x, const TensorView& packed,
                const TensorView& scale, const TensorView& offset, const TensorView& bias,
                int bits, int64_t group, void* stream = nullptr);

}  // namespace pyengine
