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
constexpr int kChunk = 16;         // tokens a chunk (their products in shared)
constexpr int kMaxKeyDim = 256;    // the gated delta rule's dk (queries and keys in shared)
constexpr int kMaxStateSize = 256;  // the scan's state size (B and C in shared)
constexpr int kMaxWidth = 8;       // the convolution's width (its window in registers)

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

// Grid (requests, value heads), kThreads threads: the request's tokens kChunk at a time
// in the chunked form of cpp/src/kernels/recurrent_chunks.inc. The chunk's normalised
// queries and keys and their decayed pairwise products are shared; thread x keeps the
// state's columns x, x + kThreads, ... (the columns evolve apart), each read twice and
// written once a chunk, where the recurrence would read and write it twice a token.
__global__ void __launch_bounds__(kThreads) delta_rule_kernel(DeltaParams p) {
  __shared__ float qs[kChunk][kMaxKeyDim], ks[kChunk][kMaxKeyDim];
  __shared__ float kk[kChunk][kChunk], qk[kChunk][kChunk];  // decayed, lower triangles
  __shared__ float factors[2 * kChunk], sums[kChunk], gammas[kChunk], weights[kChunk];
  __shared__ float betas[kChunk];
  const int r = blockIdx.x, h = blockIdx.y, kh = h / (p.hv / p.hk);
  const int64_t head_size = static_cast<int64_t>(p.dk) * p.dv;
  float* s = p.state + (static_cast<int64_t>(p.reqs.slots[r]) * p.hv + h) * head_size;
  if (p.reqs.has_state[r] == 0) {  // (the chunk's barriers publish the zeros)
    for (int64_t i = threadIdx.x; i < head_size; i += blockDim.x) s[i] = 0.0f;
  }
  const int end = p.reqs.starts[r + 1];
  for (int t0 = p.reqs.starts[r]; t0 < end; t0 += kChunk) {
    const int n = end - t0 < kChunk ? end - t0 : kChunk;
    for (int e = threadIdx.x; e < n * p.dk; e += blockDim.x) {
      const int t = e / p.dk, i = e % p.dk;
      const int64_t at = (static_cast<int64_t>(t0 + t) * p.hk + kh) * p.dk + i;
      qs[t][i] = p.q[at];
      ks[t][i] = p.k[at];
    }
    __syncthreads();
    // Each token's query and key scale (thread t: query t; thread n + t: key t), and the
    // running sums of the chunk's log decays.
    if (threadIdx.x < 2 * n) {
      const bool key = threadIdx.x >= n;
      const float* x = key ? ks[threadIdx.x - n] : qs[threadIdx.x];
      float squares = 0.0f;
      for (int i = 0; i < p.dk; ++i) squares += x[i] * x[i];
      const float norm = p.normalize ? 1.0f / sqrtf(squares + 1e-6f) : 1.0f;
      factors[threadIdx.x] = key ? norm : norm * p.scale;
    }
    if (threadIdx.x == 0) {
      float sum = 0.0f;
      for (int t = 0; t < n; ++t) {
        const int64_t row = static_cast<int64_t>(t0 + t) * p.hv + h;
        sums[t] = sum += p.g[row];
        gammas[t] = expf(sum);
        betas[t] = p.beta[row];
      }
      for (int t = 0; t < n; ++t) weights[t] = expf(sum - sums[t]);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n * p.dk; e += blockDim.x) {
      const int t = e / p.dk, i = e % p.dk;
      qs[t][i] *= factors[t];
      ks[t][i] *= factors[n + t];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n * n; e += blockDim.x) {
      const int t = e / n, u = e % n;
      float key_dot = 0.0f, query_dot = 0.0f;
      for (int i = 0; u <= t && i < p.dk; ++i) {
        key_dot += ks[t][i] * ks[u][i];
        query_dot += qs[t][i] * ks[u][i];
      }
      const float decay = u <= t ? expf(sums[t] - sums[u]) : 0.0f;
      kk[t][u] = u < t ? key_dot * decay : 0.0f;
      qk[t][u] = query_dot * decay;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < p.dv; j += blockDim.x) {
      float recall[kChunk] = {}, read[kChunk] = {}, d[kChunk] = {};
      for (int i = 0; i < p.dk; ++i) {
        const float x = s[static_cast<int64_t>(i) * p.dv + j];
#pragma unroll
        for (int t = 0; t < kChunk; ++t) {
          recall[t] += ks[t][i] * x;
          read[t] += qs[t][i] * x;
        }
      }
      // The updates solve forward (each the rows before it), then the outputs.
#pragma unroll
      for (int t = 0; t < kChunk; ++t) {
        if (t >= n) break;
        const int64_t row = static_cast<int64_t>(t0 + t) * p.hv + h;
        float value = p.v[row * p.dv + j] - gammas[t] * recall[t];
        float out = gammas[t] * read[t];
        for (int u = 0; u < t; ++u) value -= kk[t][u] * d[u];
        d[t] = betas[t] * value;
        for (int u = 0; u <= t; ++u) out += qk[t][u] * d[u];
        p.out[row * p.dv + j] = out;
      }
      const float whole = gammas[n - 1];
      for (int i = 0; i < p.dk; ++i) {
        float x = s[static_cast<int64_t>(i) * p.dv + j] * whole;
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
          if (u < n) x += ks[u][i] * weights[u] * d[u];  // (past n: stale tiles)
        }
        s[static_cast<int64_t>(i) * p.dv + j] = x;
      }
    }
    __syncthreads();  // (before the next chunk overwrites the shared tiles)
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

// Grid (requests, heads), kThreads threads: the request's tokens kChunk at a time in
// the scan's state-space dual form (cpp/src/kernels/recurrent_chunks.inc), the chunk's B
// and C of the head's group and their decayed products shared; a row of the head's
// state [head_dim, state_size] a thread (the rows evolve apart), read twice and written
// once a chunk.
__global__ void __launch_bounds__(kThreads) ssm_kernel(SsmParams p) {
  __shared__ float bs[kChunk][kMaxStateSize], cs[kChunk][kMaxStateSize];
  __shared__ float cb[kChunk][kChunk];  // C_t . B_u, decayed, times step_u (u <= t)
  __shared__ float steps[kChunk], sums[kChunk], gammas[kChunk], weights[kChunk];
  const int r = blockIdx.x, h = blockIdx.y, g = h / (p.heads / p.groups);
  const int64_t head_size = static_cast<int64_t>(p.head_dim) * p.state_size;
  float* s = p.state + (static_cast<int64_t>(p.reqs.slots[r]) * p.heads + h) * head_size;
  const float a = p.a[h], skip = p.d != nullptr ? p.d[h] : 0.0f;
  const float bias = p.dt_bias != nullptr ? p.dt_bias[h] : 0.0f;
  if (p.reqs.has_state[r] == 0) {  // (a thread's own rows: no barrier needed)
    for (int row = threadIdx.x; row < p.head_dim; row += blockDim.x) {
      for (int m = 0; m < p.state_size; ++m) s[static_cast<int64_t>(row) * p.state_size + m] = 0;
    }
  }
  const int end = p.reqs.starts[r + 1];
  for (int t0 = p.reqs.starts[r]; t0 < end; t0 += kChunk) {
    const int n = end - t0 < kChunk ? end - t0 : kChunk;
    for (int e = threadIdx.x; e < n * p.state_size; e += blockDim.x) {
      const int t = e / p.state_size, m = e % p.state_size;
      const int64_t at = (static_cast<int64_t>(t0 + t) * p.groups + g) * p.state_size + m;
      bs[t][m] = p.b[at];
      cs[t][m] = p.c[at];
    }
    if (threadIdx.x == 0) {
      float sum = 0.0f;
      for (int t = 0; t < n; ++t) {
        float step = p.dt[static_cast<int64_t>(t0 + t) * p.heads + h] + bias;
        if (p.dt_softplus) step = step > 20.0f ? step : log1pf(expf(step));
        steps[t] = fminf(fmaxf(step, p.dt_min), p.dt_max);
        sums[t] = sum += steps[t] * a;
        gammas[t] = expf(sum);
      }
      for (int t = 0; t < n; ++t) weights[t] = expf(sum - sums[t]) * steps[t];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n * n; e += blockDim.x) {
      const int t = e / n, u = e % n;
      float dot = 0.0f;
      for (int m = 0; u <= t && m < p.state_size; ++m) dot += cs[t][m] * bs[u][m];
      cb[t][u] = u <= t ? dot * expf(sums[t] - sums[u]) * steps[u] : 0.0f;
    }
    __syncthreads();
    for (int row = threadIdx.x; row < p.head_dim; row += blockDim.x) {
      float* state_row = s + static_cast<int64_t>(row) * p.state_size;
      float x[kChunk] = {}, y[kChunk] = {};
#pragma unroll
      for (int t = 0; t < kChunk; ++t) {
        if (t < n) x[t] = p.x[(static_cast<int64_t>(t0 + t) * p.heads + h) * p.head_dim + row];
      }
      for (int m = 0; m < p.state_size; ++m) {
        const float value = state_row[m];
#pragma unroll
        for (int t = 0; t < kChunk; ++t) y[t] += value * cs[t][m];
      }
#pragma unroll
      for (int t = 0; t < kChunk; ++t) {
        if (t >= n) break;
        float out = gammas[t] * y[t] + skip * x[t];
        for (int u = 0; u <= t; ++u) out += cb[t][u] * x[u];
        p.out[(static_cast<int64_t>(t0 + t) * p.heads + h) * p.head_dim + row] = out;
      }
      const float whole = gammas[n - 1];
      for (int m = 0; m < p.state_size; ++m) {
        float value = state_row[m] * whole;
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
          if (u < n) value += bs[u][m] * weights[u] * x[u];  // (past n: stale tiles)
        }
        state_row[m] = value;
      }
    }
    __syncthreads();  // (before the next chunk overwrites the shared tiles)
  }
}

}  // namespace pyengine::cuda::recurrent
