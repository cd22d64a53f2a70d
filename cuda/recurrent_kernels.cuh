// The CUDA recurrent-state kernels (launched by recurrent.cu; the contract is
// pyengine/recurrent.h's): each request's tokens in order from its state slot, the state
// in global memory, float32. Device code and plain C++ only, so that cpp/tests can run
// the kernels on the host (cuda_host_emulation.h). Internal to cuda/.
#pragma once

#include <cstdint>

#include "cuda/element_types.cuh"
#include "cuda/layer_kernels.cuh"

namespace pyengine::cuda::recurrent {

constexpr int kThreads = 128;
constexpr int kMaxKeyDim = 256;  // the gated delta rule's dk (queries and keys in shared)
constexpr int kMaxWidth = 8;     // the convolution's width (its window in registers)

// Request i's tokens are rows [starts[i], starts[i + 1]), its state slot slots[i],
// read as zeros where has_state[i] is 0.
struct Requests {
  const int32_t* starts;
  const int32_t* slots;
  const int32_t* has_state;
};

struct DeltaParams {
  float* out;
  const float *q, *k, *v, *g, *beta;
  float* state;  // [slots, hv, dk, dv]
  Requests reqs;
  int hk, hv, dk, dv;
  float scale;
  bool normalize;
};

// Grid (requests, value heads), kThreads threads: thread x keeps the state's columns x,
// x + kThreads, ... (the columns evolve apart), the token's query and key in shared.
__global__ void __launch_bounds__(kThreads) delta_rule_kernel(DeltaParams p) {
  __shared__ float qs[kMaxKeyDim], ks[kMaxKeyDim];
  __shared__ float q_sums[kThreads / kWarp], k_sums[kThreads / kWarp];
  const int r = blockIdx.x, h = blockIdx.y, kh = h / (p.hv / p.hk);
  const int64_t head_size = static_cast<int64_t>(p.dk) * p.dv;
  float* s = p.state + (static_cast<int64_t>(p.reqs.slots[r]) * p.hv + h) * head_size;
  if (p.reqs.has_state[r] == 0) {
    for (int64_t i = threadIdx.x; i < head_size; i += blockDim.x) s[i] = 0.0f;
  }
  for (int t = p.reqs.starts[r]; t < p.reqs.starts[r + 1]; ++t) {
    const float* q = p.q + (static_cast<int64_t>(t) * p.hk + kh) * p.dk;
    const float* k = p.k + (static_cast<int64_t>(t) * p.hk + kh) * p.dk;
    float qq = 0.0f, kk = 0.0f;
    for (int i = threadIdx.x; i < p.dk; i += blockDim.x) {
      qs[i] = q[i];
      ks[i] = k[i];
      qq += q[i] * q[i];
      kk += k[i] * k[i];
    }
    // (the sums' barriers also publish qs, ks and the zeroed state)
    qq = layer_kernels::block_sum(qq, q_sums);
    kk = layer_kernels::block_sum(kk, k_sums);
    const float q_factor = p.normalize ? p.scale / sqrtf(qq + 1e-6f) : p.scale;
    const float k_factor = p.normalize ? 1.0f / sqrtf(kk + 1e-6f) : 1.0f;
    const int64_t row = static_cast<int64_t>(t) * p.hv + h;
    const float decay = expf(p.g[row]), beta = p.beta[row];
    const float* v = p.v + row * p.dv;
    float* o = p.out + row * p.dv;
    for (int j = threadIdx.x; j < p.dv; j += blockDim.x) {
      float recall = 0.0f;
      for (int i = 0; i < p.dk; ++i) {
        const float x = s[static_cast<int64_t>(i) * p.dv + j] * decay;
        s[static_cast<int64_t>(i) * p.dv + j] = x;
        recall += ks[i] * k_factor * x;
      }
      const float d = beta * (v[j] - recall);
      float read = 0.0f;
      for (int i = 0; i < p.dk; ++i) {
        const float x = s[static_cast<int64_t>(i) * p.dv + j] + ks[i] * k_factor * d;
        s[static_cast<int64_t>(i) * p.dv + j] = x;
        read += qs[i] * q_factor * x;
      }
      o[j] = read;
    }
    __syncthreads();  // (before the next token's query and key overwrite these)
  }
}

struct ConvParams {
  float* out;
  const float *x, *weight, *bias;  // weight [channels, width]; bias null: none
  float* state;                    // [slots, channels, width - 1]
  Requests reqs;
  int channels, width;
  bool silu;
};

// Grid (requests, channel blocks), kThreads threads: a channel a thread, its window of
// the last width - 1 inputs in registers.
__global__ void __launch_bounds__(kThreads) conv_kernel(ConvParams p) {
  const int r = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= p.channels) return;
  const int kept = p.width - 1;
  float window[kMaxWidth];  // oldest first
  float* st = p.state + (static_cast<int64_t>(p.reqs.slots[r]) * p.channels + c) * kept;
  const bool fresh = p.reqs.has_state[r] == 0;
  for (int m = 0; m < kept; ++m) window[m] = fresh ? 0.0f : st[m];
  const float* w = p.weight + static_cast<int64_t>(c) * p.width;
  for (int t = p.reqs.starts[r]; t < p.reqs.starts[r + 1]; ++t) {
    const float x = p.x[static_cast<int64_t>(t) * p.channels + c];
    float acc = p.bias != nullptr ? p.bias[c] : 0.0f;
    for (int m = 0; m < kept; ++m) acc += w[m] * window[m];
    acc += w[kept] * x;
    for (int m = 0; m + 1 < kept; ++m) window[m] = window[m + 1];
    if (kept > 0) window[kept - 1] = x;
    p.out[static_cast<int64_t>(t) * p.channels + c] = p.silu ? acc / (1.0f + expf(-acc)) : acc;
  }
  for (int m = 0; m < kept; ++m) st[m] = window[m];
}

struct SsmParams {
  float* out;
  const float *x, *dt, *a, *b, *c, *d, *dt_bias;  // d, dt_bias null: zeros
  float* state;                                  // [slots, heads, head_dim, state_size]
  Requests reqs;
  int heads, head_dim, groups, state_size;
  float dt_min, dt_max;
  bool dt_softplus;
};

// Grid (requests, heads), kThreads threads: a row of the head's state [head_dim,
// state_size] a thread (the rows evolve apart).
__global__ void __launch_bounds__(kThreads) ssm_kernel(SsmParams p) {
  const int r = blockIdx.x, h = blockIdx.y, g = h / (p.heads / p.groups);
  const int64_t head_size = static_cast<int64_t>(p.head_dim) * p.state_size;
  float* s = p.state + (static_cast<int64_t>(p.reqs.slots[r]) * p.heads + h) * head_size;
  const bool fresh = p.reqs.has_state[r] == 0;
  const float a = p.a[h], skip = p.d != nullptr ? p.d[h] : 0.0f;
  const float bias = p.dt_bias != nullptr ? p.dt_bias[h] : 0.0f;
  for (int row = threadIdx.x; row < p.head_dim; row += blockDim.x) {
    float* state_row = s + static_cast<int64_t>(row) * p.state_size;
    if (fresh) {
      for (int n = 0; n < p.state_size; ++n) state_row[n] = 0.0f;
    }
    for (int t = p.reqs.starts[r]; t < p.reqs.starts[r + 1]; ++t) {
      float step = p.dt[static_cast<int64_t>(t) * p.heads + h] + bias;
      if (p.dt_softplus) step = step > 20.0f ? step : log1pf(expf(step));
      step = fminf(fmaxf(step, p.dt_min), p.dt_max);
      const float decay = expf(step * a);
      const int64_t token_head = static_cast<int64_t>(t) * p.heads + h;
      const float x = p.x[token_head * p.head_dim + row];
      const int64_t group_at = (static_cast<int64_t>(t) * p.groups + g) * p.state_size;
      float y = 0.0f;
      for (int n = 0; n < p.state_size; ++n) {
        const float value = state_row[n] * decay + step * x * p.b[group_at + n];
        state_row[n] = value;
        y += value * p.c[group_at + n];
      }
      p.out[token_head * p.head_dim + row] = y + skip * x;
    }
  }
}

}  // namespace pyengine::cuda::recurrent
