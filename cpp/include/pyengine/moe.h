// Mixture-of-experts layers: each token's experts chosen from its router logits (softmax
// top-k), and on the CPU the routed experts' product over panel-packed weights (and a
// shared expert's, which every token takes); on CUDA the same product in three kernels
// over the tokens' slots grouped by expert (moe_align_blocks, moe_expert_gemm twice,
// moe_combine; see the end).
//
// The experts' weights are stacked, one packed weight a row: gate_up [experts, S1], each
// row a [hidden, 2 * n] gate/up weight as dense_silu_and_mul takes it (float32
// pack_gate_up_weight, block-quantized pack_quantized_weight with gate_up, or bfloat16
// pack_bf16_weight with gate_up), and down [experts, S2], each row a [n, hidden] weight as
// dense takes it, n the expert's intermediate size. The tokens are grouped by expert and
// each active expert's rows multiplied by its weights once: a decode step of a few
// tokens reads each active expert's bytes once, and no expert that no token chose.
#pragma once

#include <cstdint>

#include "pyengine/tensor_view.h"

namespace pyengine {

// ids [t, top_k] (int32) and weights [t, top_k] (float32): each row's top_k experts by
// softmax(logits [t, experts], float32 or bfloat16; the softmax in float32), highest
// first (equal logits: the lower id first), each weight its softmax probability,
// divided by the top_k's sum where `renormalize` (as Mixtral and Qwen2/3-MoE route).
// top_k in [1, experts]. On CUDA (logits float32, float16 or bfloat16; ids and weights
// dense, on the same device) on `stream`, a cudaStream_t.
void moe_softmax_topk(const TensorView& ids, const TensorView& weights, const TensorView& logits,
                      bool renormalize, void* stream = nullptr);

// DeepSeek-V3's routing, as moe_softmax_topk's rows: scores sigmoid(logits), chosen by
// scores + bias (float32 [experts], the correction bias; bias.data null: none): the
// experts' num_groups groups each scored by the sum of its best two, the topk_groups
// best groups, then the top_k experts within them (equal values: the lower index
// first); each weight its score, divided by the top_k's sum (+ 1e-20) where
// `renormalize`, times scaling_factor (routed_scaling_factor).
void moe_grouped_topk(const TensorView& ids, const TensorView& weights, const TensorView& logits,
                      const TensorView& bias, int64_t num_groups, int64_t topk_groups,
                      bool renormalize, double scaling_factor);

// Llama 4's: the top_k by logit, each weight sigmoid(logit) (which fused_experts applies
// to the input, on_input).
void moe_sigmoid_topk(const TensorView& ids, const TensorView& weights, const TensorView& logits);

// out [t, hidden] = sum over s < top_k of weights[r, s] * E_ids[r, s](x[r]) for each row r,
// E_e(v) = down_e(silu(v @ gate_e) * (v @ up_e)); with `on_input`, E_e(weights[r, s] *
// x[r]) instead (Llama 4 scales the experts' input). The experts' sums are added to a
// row in ascending expert order (as transformers' index_add over its experts). x and out
// float32 (or bfloat16 with bfloat16 panels: the sums kept in float32 and rounded once);
// ids int32 [t, top_k] in [0, experts), an expert may repeat; weights float32 [t, top_k].
// int8_activations: as dense's. out must not overlap x. With a shared expert (its
// gate_up.data set), every row also adds, after its routed experts, the shared expert's
// output, times sigmoid(x[r] . gate) where a gate is given. With expert parallelism the
// stacks hold a rank's experts [first_expert, first_expert + experts) of the layer's
// num_experts (0: the stacks' count), and the slots that route elsewhere add nothing.
// How each expert turns its gate/up product into its down product's input. By default
// silu(gate) * up, gate_up packed as dense_silu_and_mul's pairs. clamped_swiglu
// (gpt-oss's): g = min(gate, limit), u = clamp(up, -limit, limit), g * sigmoid(alpha g) *
// (u + 1). Biases (gpt-oss's), float32 on the CPU: gate_up_bias [experts, 2n] added to
// the gate/up product ([gate | up]), down_bias [experts, hidden] to the down product
// (data null: none). With either, gate_up is packed as one plain [hidden, 2n] weight per
// expert (pack_weight's or pack_bf16_weight's without gate_up: [gate | up] columns).
struct ExpertActivation {
  bool clamped_swiglu = false;
  float alpha = 1.702f, limit = 7.0f;
  TensorView gate_up_bias, down_bias;
};

struct SharedExpert {
  TensorView gate_up;  // one packed [hidden, 2 * n] weight, as dense_silu_and_mul takes it
  TensorView down;     // one packed [n, hidden] weight
  TensorView gate;     // float32 [hidden] (Qwen2-MoE's shared_expert_gate), or none
  int64_t n = 0;       // its intermediate size
};
void fused_experts(const TensorView& out, const TensorView& x, const TensorView& ids,
                   const TensorView& weights, const TensorView& gate_up, const TensorView& down,
                   int64_t n, bool on_input, bool int8_activations = false,
                   const SharedExpert& shared = {}, int64_t first_expert = 0,
                   int64_t num_experts = 0, const ExpertActivation& activation = {});

// CUDA: a layer's routed experts over the slots (row r's s-th choice: slot r * top_k + s)
// grouped by expert. Every tensor on one CUDA device, the activations and weights float16
// or bfloat16 (x's dtype), on `stream`; InvalidArgument for CPU tensors (whose product
// is fused_experts) or without a CUDA build. The expert ids are not read back to be
// checked: one outside the rank's experts adds nothing.

// Slots an aligned block holds, and the most blocks `slots` slots over `experts` experts
// take (moe_align_blocks' sizes).
inline constexpr int64_t kMoeBlockRows = 16;
int64_t moe_max_blocks(int64_t slots, int64_t experts);

// The slots of this rank's experts [first_expert, first_expert + experts) grouped by
// expert, slots ascending within one, in blocks of kMoeBlockRows of one expert (padded
// with -1): sorted int32 [max_blocks * kMoeBlockRows], block_experts int32 [max_blocks]
// (each block's local expert, -1 past the used ones), max_blocks = moe_max_blocks(ids'
// t * top_k, experts); ids int32 [t, top_k], dense.
void moe_align_blocks(const TensorView& sorted, const TensorView& block_experts,
                      const TensorView& ids, int64_t first_expert, int64_t experts,
                      void* stream = nullptr);

// The experts' products over the aligned blocks, weights w stacked [experts, rows, k]
// (dense). gate_up: out [t * top_k, n] (x's dtype) = silu(x_r @ gate^T) * (x_r @ up^T)
// for each slot of row r, w [experts, 2n, k] (the gate's n rows first), x [t, k] (with
// on_input each row scaled by the slot's weight first); else out float32 [slots, n] =
// x_slot @ w[e]^T times the slot's weight (unless on_input), w [experts, n, k], x
// [slots, k] (the gate/up's out). weights float32 [t, top_k] dense; k a multiple of 16.
void moe_expert_gemm(const TensorView& out, const TensorView& x, const TensorView& w,
                     const TensorView& sorted, const TensorView& block_experts,
                     const TensorView& weights, int64_t top_k, bool gate_up, bool on_input,
                     void* stream = nullptr);

// out [t, hidden] (16-bit) = each row's slots' rows of y float32 [t * top_k, hidden] (the
// down product's), of this rank's experts only, added in ascending expert order.
void moe_combine(const TensorView& out, const TensorView& y, const TensorView& ids,
                 int64_t first_expert, int64_t experts, void* stream = nullptr);

}  // namespace pyengine
