// Fused per-token layers of the model forward pass, CPU: one pass over each row instead of
// the several tensor ops (and temporaries) the same math takes in torch.
//
// Every tensor is [num_tokens, ...] with a dense last dim; dtypes float32, float16 or
// bfloat16 (all of one call alike; arithmetic in float32). Each throws InvalidArgument
// naming the argument, before writing anything. Compiled without floating-point
// contraction, so that results round like the unfused torch ops.
//
// All of a call's tensors are on one device: the CPU, or a CUDA device where pyengine
// was built with CUDA (the kernels of cuda/layer_kernels.cuh, run on `stream`, a
// cudaStream_t; nullptr: the default stream; unused on the CPU).
#pragma once

#include "pyengine/tensor_view.h"

namespace pyengine {

// out = x / sqrt(mean(x^2) + eps) * weight, per row.   x, out: [num_tokens, hidden], or on
// the CPU [num_tokens, heads, head_size] with dense heads, a row a head (per-head norms)
void rms_norm(const TensorView& out, const TensorView& x, const TensorView& weight, float eps,
              void* stream = nullptr);

// residual += x; x = rms_norm(residual) * weight, in place (the residual stream of a
// pre-norm decoder layer).
void fused_add_rms_norm(const TensorView& x, const TensorView& residual, const TensorView& weight,
                        float eps, void* stream = nullptr);

// out = a + b, elementwise: the residual stream's last sum (a kernel, so that a
// KernelProgram records it). CPU only; a, b, out [num_tokens, hidden] alike.
void add(const TensorView& out, const TensorView& a, const TensorView& b);

// out[t] = weight[ids[t]], a token embedding's rows (a kernel, so that a KernelProgram
// records it). CPU only; weight [vocab, hidden] and out [num_tokens, hidden] of one
// dtype; ids int32 or int64 [num_tokens], each in [0, vocab).
void embedding(const TensorView& out, const TensorView& weight, const TensorView& ids);

// Rotary position embedding in place: for i < d/2 the pair (x[j], x[k]) becomes
// (x[j] c - x[k] s, x[k] c + x[j] s) with c, s = cos_sin_cache[position][i],
// cos_sin_cache[position][d/2 + i], where (j, k) = (i, i + d/2) in the rotate-half
// ("neox") form of Llama and Qwen in transformers, (2i, 2i + 1) in the interleaved
// ("gpt-j") form.
//   positions: int32 or int64 [num_tokens];  query: [num_tokens, heads, d];
//   key: [num_tokens, kv_heads, d];  cos_sin_cache: float32 [max_positions, d]
void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView& cos_sin_cache, bool is_neox = true, void* stream = nullptr);

// out = silu(x[:, :n]) * x[:, n:], with x [num_tokens, 2n] and out [num_tokens, n].
void silu_and_mul(const TensorView& out, const TensorView& x, void* stream = nullptr);

// out = gelu(x[:, :n]) * x[:, n:], gelu's tanh approximation (Gemma's GeGLU); the CPU's.
void gelu_tanh_and_mul(const TensorView& out, const TensorView& x);

// out = x * factor (factor as float32; Gemma's embedding scale), [tokens, n]; the CPU's.
void scale(const TensorView& out, const TensorView& x, double factor);

}  // namespace pyengine
