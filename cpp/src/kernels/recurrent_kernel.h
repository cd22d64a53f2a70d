// The loops of the recurrent-state kernels (gated_delta_rule.cpp, causal_conv1d.cpp,
// ssm_scan.cpp),
// built once per instruction set (recurrent_kernel.inc) and picked at run time by
// attention_isa(), as the attention kernels are.
#pragma once

#include <atomic>
#include <cstdint>

#include "pyengine/attention.h"

namespace pyengine::detail {

// One request's tokens through one value head's gated delta rule.
struct DeltaRun {
  const float *q, *k, *v, *g, *beta;  // at the run's first token (q, k: the key head's)
  int64_t qk_stride, v_stride, gate_stride;  // from a token to the next
  float* out;                                // (out strides as v)
  float* state;                              // [dk, dv]
  int64_t tokens, dk, dv;
  float scale;
  bool normalize, fresh;  // fresh: the state taken as zeros
};

// One request's tokens through the causal convolution, every channel.
struct ConvRun {
  const float* x;  // [tokens, channels] (rows `channels` apart)
  float* out;
  const float* weight_t;  // [width, channels] (the weight transposed)
  const float* bias;      // [channels] or null
  float* state;           // [channels, width - 1]
  int64_t tokens, channels, width;
  bool silu, fresh;
};

// One request's tokens through one head of Mamba-2's state-space recurrence.
struct SsmRun {
  const float *x, *dt, *b, *c;  // at the run's first token (b, c: the head's group's)
  int64_t x_stride, dt_stride, bc_stride;  // from a token to the next
  float* out;                              // (out strides as x)
  float* state;                            // [head_dim, state_size]
  float a, d, dt_bias, dt_min, dt_max;
  int64_t tokens, head_dim, state_size;
  bool dt_softplus, fresh;
};

// set_recurrent_chunks_from's pin (0: none).
inline std::atomic<int64_t> chunks_from_pin{0};

// Whether a run of `tokens` tokens goes by chunks: from `fallback` tokens up (the
// kernel's default) unless pinned.
inline bool by_chunks(int64_t tokens, int64_t fallback) {
  const int64_t pin = chunks_from_pin.load(std::memory_order_relaxed);
  return tokens >= (pin > 0 ? pin : fallback);
}

// One instruction set's build of the loops.
struct RecurrentBuild {
  void (*delta_rule)(const DeltaRun&);
  void (*conv)(const ConvRun&);
  void (*ssm)(const SsmRun&);
};

#define PYENGINE_RECURRENT_BUILD(ns)      \
  namespace ns {                          \
  void delta_rule_run(const DeltaRun& r); \
  void conv_run(const ConvRun& r);        \
  void ssm_run(const SsmRun& r);          \
  }
PYENGINE_RECURRENT_BUILD(generic)
PYENGINE_RECURRENT_BUILD(avx2)
PYENGINE_RECURRENT_BUILD(avx512)
#undef PYENGINE_RECURRENT_BUILD

// The build for `isa` (attention_isa(): the attention kernels' pin).
inline RecurrentBuild recurrent_build(CpuIsa isa) {
#ifdef PYENGINE_X86_KERNELS
  if (isa == CpuIsa::kAvx512) return {avx512::delta_rule_run, avx512::conv_run, avx512::ssm_run};
  if (isa == CpuIsa::kAvx2) return {avx2::delta_rule_run, avx2::conv_run, avx2::ssm_run};
#endif
  (void)isa;
  return {generic::delta_rule_run, generic::conv_run, generic::ssm_run};
}

}  // namespace pyengine::detail
