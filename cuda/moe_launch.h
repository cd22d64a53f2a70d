// Host-side launchers of the CUDA mixture-of-experts kernels (cuda/moe_kernels.cuh).
// Plain C++ (no CUDA types), called by the glue in cpp/src/kernels/moe_cuda.cpp once it
// has checked every argument (see pyengine/moe.h). Each runs on `stream` (a cudaStream_t;
// nullptr: the default stream) of the tensors' device. Expert ids live on the device and
// are not read back: one outside the rank's experts adds nothing.
#pragma once

#include "pyengine/tensor_view.h"

namespace pyengine::cuda {

// The most experts a rank holds and the most a token takes that the kernels take, and the
// slots of an aligned block.
inline constexpr int kMoeMaxExperts = 1024;
inline constexpr int kMoeMaxTopK = 32;
inline constexpr int kMoeBlockRows = 16;

void moe_softmax_topk(const TensorView& ids, const TensorView& weights, const TensorView& logits,
                      bool renormalize, void* stream);

void moe_align_blocks(const TensorView& sorted, const TensorView& block_experts,
                      const TensorView& ids, int first_expert, int experts, void* stream);

// gate_up: out (x's dtype) [slots, n] = silu(gate) * up of w [experts, 2n, k]; else out
// float32 [slots, n] = h @ w[e]^T times the slot's weight (unless on_input).
void moe_expert_gemm(const TensorView& out, const TensorView& x, const TensorView& w,
                     const TensorView& sorted, const TensorView& block_experts,
                     const TensorView& weights, int top_k, bool gate_up, bool on_input,
                     void* stream);

void moe_combine(const TensorView& out, const TensorView& y, const TensorView& ids,
                 int first_expert, int experts, void* stream);

}  // namespace pyengine::cuda
