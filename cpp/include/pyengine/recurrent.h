// The kernels of layers that carry a fixed-size recurrent state per request instead of
// a growing KV cache (Gated DeltaNet in Qwen3-Next and Qwen3.5, Mamba-2's scan in its
// hybrids, and the short causal convolution before either). Each step's tokens are requests'
// runs, as attention's are: request i's tokens are rows [query_start_loc[i],
// query_start_loc[i + 1]), in order, and its state is slot state_slots[i] of the state
// tensor, read (or taken as zeros where has_state[i] is 0: a new request) and written
// back after its last token. A step may mix prefilling and decoding requests. Float32,
// every tensor dense, on the CPU or on CUDA (`stream` a cudaStream_t, nullptr: the
// default stream; the request arrays stay on the device and are not read back to be
// checked). Throws InvalidArgument naming the argument, before writing anything.
#pragma once

#include "pyengine/tensor_view.h"

namespace pyengine {

// Gated DeltaNet's recurrence (the gated delta rule): decode token by token, a prefill's
// long runs by its chunked parallel form, the same sums in another order. For a value head h
// (its key head h / (Hv / Hk)) and token t, with S the head's state [dk, dv]:
//   S = exp(g[t, h]) * S;  d = beta[t, h] * (v[t, h] - S^T k[t]);  S += k[t] d^T;
//   out[t, h] = S^T q[t] * scale
// where q and k are first scaled to unit L2 norm (x / sqrt(|x|^2 + 1e-6)) if normalize.
//   out:         [T, Hv, dv] (written)
//   query, key:  [T, Hk, dk], Hv a multiple of Hk
//   value:       [T, Hv, dv]
//   g, beta:     [T, Hv] (g the log of the decay, beta in [0, 1])
//   state:       [num_slots, Hv, dk, dv] (read and written)
//   state_slots, has_state: int32 [num_reqs]; query_start_loc: int32 [num_reqs + 1]
void gated_delta_rule(const TensorView& out, const TensorView& query, const TensorView& key,
                      const TensorView& value, const TensorView& g, const TensorView& beta,
                      const TensorView& state, const TensorView& state_slots,
                      const TensorView& has_state, const TensorView& query_start_loc,
                      float scale, bool normalize, void* stream = nullptr);

// The depthwise causal convolution of width K over each request's tokens, continued
// from its state (the K - 1 inputs before its first token, oldest first), then SiLU
// where silu: out[t, c] = act(bias[c] + sum_j weight[c, j] * x[t - (K - 1) + j, c]).
//   out, x:  [T, C]
//   weight:  [C, K]; bias: [C] or empty (no bias)
//   state:   [num_slots, C, K - 1] (read and written: the last K - 1 inputs)
void causal_conv1d(const TensorView& out, const TensorView& x, const TensorView& weight,
                   const TensorView& bias, const TensorView& state, const TensorView& state_slots,
                   const TensorView& has_state, const TensorView& query_start_loc, bool silu,
                   void* stream = nullptr);

// Mamba-2's state-space recurrence (its selective scan): decode token by token, long runs
// by chunks (its state-space dual form). For head h (of
// group h / (H / G)) and token t, with S the head's state [P, N]:
//   step = clamp(softplus(dt[t, h] + dt_bias[h]), dt_min, dt_max)  (no softplus unless
//          dt_softplus);
//   S = exp(step * A[h]) * S + step * x[t, h] B[t, g]^T;  out[t, h] = S C[t, g] + D[h] x[t, h]
//   out, x:      [T, H, P]
//   dt:          [T, H]
//   A:           [H] (negative: -exp(A_log)); D, dt_bias: [H] or empty (zeros)
//   B, C:        [T, G, N], H a multiple of G
//   state:       [num_slots, H, P, N] (read and written)
void ssm_scan(const TensorView& out, const TensorView& x, const TensorView& dt,
              const TensorView& A, const TensorView& B, const TensorView& C, const TensorView& D,
              const TensorView& dt_bias, const TensorView& state, const TensorView& state_slots,
              const TensorView& has_state, const TensorView& query_start_loc, bool dt_softplus,
              float dt_min, float dt_max, void* stream = nullptr);

// The form a run of tokens takes on the CPU in gated_delta_rule and ssm_scan: runs of at
// least `tokens` tokens go by the chunked parallel form (prefill's), shorter ones token by
// token; 0 restores each kernel's measured default. Tests pin either form with it (1: every
// run by chunks), as they pin the instruction set.
void set_recurrent_chunks_from(int64_t tokens);

}  // namespace pyengine
