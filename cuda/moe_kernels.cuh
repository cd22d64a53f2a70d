// Mixture-of-experts layers on CUDA (launched by moe.cu), in four kernels:
//
// - softmax_topk_kernel: a warp a token row: the softmax of its router logits (in float32)
//   and its top k experts by logit, highest first (equal logits: the lower id first),
//   each weight its probability, renormalised over the k where asked (as the CPU's
//   moe_softmax_topk).
// - align_kernel: one block groups the slots (row r's s-th choice: slot r * top_k + s)
//   of a rank's experts by expert, in blocks of kBlockRows slots of one expert (the last
//   of an expert padded with -1), slots ascending within an expert; each block's expert,
//   and -1 for the blocks past the used ones. Each thread counts, then fills, whole
//   experts (no atomics: the order is the same every run).
// - expert_gemm_kernel: a block of kWarps warps over one aligned block of slots and
//   kWarps x 8 output columns, each warp an 8-column tile through tensor-core mma
//   (m16n8k16, float32 sums), its A rows gathered by slot. The gate/up product (kGateUp)
//   runs the gate's and the up's columns side by side and writes silu(gate) * up per
//   slot, [slots, n] in the 16-bit type; the down product writes each slot's float32
//   row, times its weight (unless the weights scaled the input: Llama 4).
// - combine_kernel: a block a token row: the sum of its slots' rows, in ascending expert
//   order (as the CPU and transformers add them), in the 16-bit type.
//
// The weights are the model's, 16-bit, stacked [experts, rows, k] (gate_up: the gate's
// n rows, then the up's). Device code and plain C++ only (cuda_host_emulation.h).
// Internal to cuda/.
#pragma once

#include <cstdint>

#include "cuda/element_types.cuh"
#include "cuda/mma_primitives.cuh"
#include "cuda/moe_launch.h"

namespace pyengine::cuda::moe_kernels {

constexpr int kBlockRows = kMoeBlockRows;  // slots an aligned block holds (an mma's m)
constexpr int kTopkWarps = 4;              // token rows a softmax_topk block routes
constexpr int kAlignThreads = 256;
constexpr int kMaxExperts = kMoeMaxExperts;  // (the glue checks both)
constexpr int kMaxTopK = kMoeMaxTopK;
constexpr int kWarps = 4;  // a GEMM block's warps, each an 8-column tile
constexpr int kTileColumns = 8;
constexpr int kCombineThreads = 256;

// Whether (v, e) comes before (best_v, best_e) in the top-k order: higher logit first,
// the lower id on equal logits.
__device__ __forceinline__ bool ranks_before(float v, int e, float best_v, int best_e) {
  return v > best_v || (v == best_v && e < best_e);
}

template <typename T>
__global__ void __launch_bounds__(kTopkWarps* kWarp)
    softmax_topk_kernel(int32_t* __restrict__ ids, float* __restrict__ weights,
                        const T* __restrict__ logits, int64_t logit_stride, int rows, int experts,
                        int top_k, bool renormalize) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int row = blockIdx.x * kTopkWarps + warp;
  if (row >= rows) return;  // (a whole warp)
  const T* l = logits + row * logit_stride;
  float most = -INFINITY;
  for (int e = lane; e < experts; e += kWarp) most = fmaxf(most, to_float(l[e]));
  most = warp_max(most);
  float sum = 0.0f;
  for (int e = lane; e < experts; e += kWarp) sum += expf(to_float(l[e]) - most);
  sum = warp_sum(sum);
  // Each pick is the first in the order after the one before it.
  float last_v = INFINITY, chosen = 0.0f;
  int last_e = -1;
  for (int s = 0; s < top_k; ++s) {
    float best_v = -INFINITY;
    int best_e = experts;  // (none yet)
    for (int e = lane; e < experts; e += kWarp) {
      const float v = to_float(l[e]);
      if (ranks_before(last_v, last_e, v, e) && ranks_before(v, e, best_v, best_e)) {
        best_v = v;
        best_e = e;
      }
    }
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      const float other_v = __shfl_xor_sync(0xffffffffu, best_v, offset);
      const int other_e = __shfl_xor_sync(0xffffffffu, best_e, offset);
      if (ranks_before(other_v, other_e, best_v, best_e)) {
        best_v = other_v;
        best_e = other_e;
      }
    }
    last_v = best_v;
    last_e = best_e;
    const float p = expf(best_v - most) / sum;
    chosen += p;
    if (lane == 0) {
      ids[static_cast<int64_t>(row) * top_k + s] = best_e;
      weights[static_cast<int64_t>(row) * top_k + s] = p;
    }
  }
  if (renormalize && lane == 0) {
    for (int s = 0; s < top_k; ++s) weights[static_cast<int64_t>(row) * top_k + s] /= chosen;
  }
}

// One block of kAlignThreads. ids int32 [slots] (a row's top_k choices, rows in order);
// the rank's experts are [first, first + experts). sorted [max_blocks * kBlockRows],
// block_experts [max_blocks]: every block's local expert or -1 (its sorted entries are
// then not written).
__global__ void __launch_bounds__(kAlignThreads)
    align_kernel(int32_t* __restrict__ sorted, int32_t* __restrict__ block_experts,
                 const int32_t* __restrict__ ids, int slots, int first, int experts,
                 int max_blocks) {
  __shared__ int first_block[kMaxExperts + 1];  // each expert's first block, then the end
  for (int e = threadIdx.x; e < experts; e += kAlignThreads) {
    int count = 0;
    for (int s = 0; s < slots; ++s) count += ids[s] == first + e ? 1 : 0;
    first_block[e + 1] = (count + kBlockRows - 1) / kBlockRows;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    first_block[0] = 0;
    for (int e = 0; e < experts; ++e) first_block[e + 1] += first_block[e];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += kAlignThreads) {
    int at = first_block[e] * kBlockRows;
    for (int s = 0; s < slots; ++s) {
      if (ids[s] == first + e) sorted[at++] = s;
    }
    for (const int end = first_block[e + 1] * kBlockRows; at < end; ++at) sorted[at] = -1;
    for (int b = first_block[e]; b < first_block[e + 1]; ++b) block_experts[b] = e;
  }
  for (int b = first_block[experts] + threadIdx.x; b < max_blocks; b += kAlignThreads) {
    block_experts[b] = -1;
  }
}

struct ExpertGemmParams {
  void* out;                     // gate/up: T [slots, n]; down: float32 [slots, n]
  const void* x;                 // gate/up: T [tokens, k] (slot s's: row s / top_k);
                                 // down: T [slots, k]
  const void* w;                 // T [experts, rows, k]: gate/up 2n rows (gate, then up), down n
  const int32_t* sorted;         // align_kernel's
  const int32_t* block_experts;  // align_kernel's
  const float* weights;          // float32 [slots]
  int64_t out_stride, x_stride;
  int n, k, top_k;
  bool on_input;  // the weights scale each slot's input (gate/up), not its output (down)
};

// Two consecutive 16-bit elements as one mma operand register (both in one 32-bit word:
// the glue checks that k and the row strides are even).
template <typename T>
__device__ __forceinline__ uint32_t pair_at(const T* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// grid (ceil(n / (kWarps * 8)), max_blocks), kWarps warps a block; k a multiple of 16.
template <typename T, bool kGateUp>
__global__ void __launch_bounds__(kWarps* kWarp) expert_gemm_kernel(const ExpertGemmParams p) {
  const int expert = p.block_experts[blockIdx.y];
  if (expert < 0) return;  // (a block past the used ones)
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int tile = blockIdx.x * kWarps + warp;
  if (tile * kTileColumns >= p.n) return;  // (a whole warp: no mma is left half-done)
  const int g = lane / 4, t = lane % 4;
  const int32_t* slots = p.sorted + static_cast<int64_t>(blockIdx.y) * kBlockRows;
  // This lane's A rows (g and g + 8 of the block): their x rows and input scales.
  const T* rows[2] = {nullptr, nullptr};
  float scales[2] = {0.0f, 0.0f};
  for (int half = 0; half < 2; ++half) {
    const int slot = slots[g + 8 * half];
    if (slot < 0) continue;
    const int64_t row = kGateUp ? slot / p.top_k : slot;
    rows[half] = static_cast<const T*>(p.x) + row * p.x_stride;
    scales[half] = kGateUp && p.on_input ? p.weights[slot] : 1.0f;
  }
  const int column = tile * kTileColumns + g;  // this lane's B column
  const bool real = column < p.n;
  const int64_t w_rows = kGateUp ? 2 * static_cast<int64_t>(p.n) : p.n;
  const T* w = static_cast<const T*>(p.w) + (expert * w_rows + (real ? column : 0)) * p.k;
  const T* up = w + static_cast<int64_t>(p.n) * p.k;
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f}, c_up[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int k0 = 0; k0 < p.k; k0 += 16) {
    // A register i: row g + 8 (i % 2), columns k0 + 2t + 8 (i / 2) + {0, 1}.
    uint32_t a[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const T* row = rows[i % 2];
      const int at = k0 + 2 * t + 8 * (i / 2);
      const float s = scales[i % 2];
      a[i] = row == nullptr ? 0u
             : s == 1.0f    ? pair_at(row + at)
                            : pack<T>(to_float(row[at]) * s, to_float(row[at + 1]) * s);
    }
    // B register j: k rows k0 + 2t + 8j + {0, 1} of column `column`: its weight row's.
    const int at = k0 + 2 * t;
    mma<T>(c, a, real ? pair_at(w + at) : 0u, real ? pair_at(w + at + 8) : 0u);
    if constexpr (kGateUp) {
      mma<T>(c_up, a, real ? pair_at(up + at) : 0u, real ? pair_at(up + at + 8) : 0u);
    }
  }
  // C element e: row g + 8 (e / 2), column 8 tile + 2t + e % 2.
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int slot = slots[g + 8 * (e / 2)];
    const int col = tile * kTileColumns + 2 * t + e % 2;
    if (slot < 0 || col >= p.n) continue;
    if constexpr (kGateUp) {
      // (the gate and up products rounded to T first, as a 16-bit model's are)
      const float gate = to_float(from_float<T>(c[e])), product = to_float(from_float<T>(c_up[e]));
      const float h = gate / (1.0f + expf(-gate)) * product;
      static_cast<T*>(p.out)[slot * p.out_stride + col] = from_float<T>(h);
    } else {
      const float weight = p.on_input ? 1.0f : p.weights[slot];
      static_cast<float*>(p.out)[slot * p.out_stride + col] = c[e] * weight;
    }
  }
}

// A block a token row, kCombineThreads threads over its columns. ids int32 [rows,
// top_k]; y float32 [rows * top_k, hidden]: each slot's weighted row (of this rank's
// experts [first, first + experts) only: the others' are not read).
template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(T* __restrict__ out, int64_t out_stride, const float* __restrict__ y,
                   int64_t y_stride, const int32_t* __restrict__ ids, int top_k, int first,
                   int experts, int hidden) {
  __shared__ int order[kMaxTopK];  // the row's local slots, in ascending expert order
  __shared__ int count;
  const int64_t row = blockIdx.x;
  const int32_t* mine = ids + row * top_k;
  if (threadIdx.x == 0) {
    count = 0;
    for (int s = 0; s < top_k; ++s) {
      const int e = mine[s];
      if (e < first || e >= first + experts) continue;
      int at = count++;  // (an insertion: equal experts keep their slot order)
      for (; at > 0 && mine[order[at - 1]] > e; --at) order[at] = order[at - 1];
      order[at] = s;
    }
  }
  __syncthreads();
  for (int col = threadIdx.x; col < hidden; col += kCombineThreads) {
    float sum = 0.0f;
    for (int i = 0; i < count; ++i) sum += y[(row * top_k + order[i]) * y_stride + col];
    out[row * out_stride + col] = from_float<T>(sum);
  }
}

}  // namespace pyengine::cuda::moe_kernels
