// Mixture-of-experts layers on the CPU: each token's experts chosen from its router
// logits (softmax top-k), and the routed experts' product over panel-packed weights (and
// a shared expert's, which every token takes).
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
// top_k in [1, experts].
void moe_softmax_topk(const TensorView& ids, const TensorView& weights, const TensorView& logits,
                      bool renormalize);

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
                   int64_t num_experts = 0);

}  // namespace pyengine
