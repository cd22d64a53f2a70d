// Batched LoRA on CUDA (launched by lora.cu): the CPU's lora_add (cpp/include/pyengine/
// lora.h) in one kernel, a thread block per token row (BGMV: decode rows each read their
// adapter's A and B, which L2 holds for the step's other rows of that adapter). Its
// warps shrink x @ A.T, a rank row each at a time (a warp's lanes along k, then a warp
// sum), into shared memory; then its threads expand over the row's columns, each column
// summing its part's ranks, and add the delta, times the scale, to the product. Float32
// arithmetic over float16 or bfloat16 storage. Device code and plain C++ only
// (cuda_host_emulation.h). Internal to cuda/.
#pragma once

#include <cstdint>

#include "cuda/element_types.cuh"
#include "cuda/lora_launch.h"

namespace pyengine::cuda::lora_kernels {

constexpr int kThreads = 256;
constexpr int kMaxRanks = kLoRAMaxRanks;  // (the glue checks both)
constexpr int kMaxParts = kLoRAMaxParts;

struct LoRAParams {
  void* out;
  const void* x;
  const void* a;  // [slots, ranks, k]
  const void* b;  // [slots, ranks, n]
  const int32_t* slots;
  const float* scale;
  int64_t part_columns[kMaxParts + 1];  // by value: [num_parts + 1]
  int64_t out_stride, x_stride, n, k;
  int ranks, num_parts, num_slots;
};

template <typename T>
__global__ void __launch_bounds__(kThreads) lora_add_kernel(const LoRAParams p) {
  __shared__ float shrunk[kMaxRanks];
  const int64_t token = blockIdx.x;
  const int slot = p.slots[token];
  // The whole block: no adapter on this row (a slot outside the slots, never read back
  // to be checked, counts as none).
  if (slot < 0 || slot >= p.num_slots) return;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const T* x = static_cast<const T*>(p.x) + token * p.x_stride;
  const T* a = static_cast<const T*>(p.a) + static_cast<int64_t>(slot) * p.ranks * p.k;
  for (int r = warp; r < p.ranks; r += kThreads / kWarp) {
    const T* row = a + static_cast<int64_t>(r) * p.k;
    float sum = 0.0f;
    for (int64_t i = lane; i < p.k; i += kWarp) sum += to_float(x[i]) * to_float(row[i]);
    sum = warp_sum(sum);
    if (lane == 0) shrunk[r] = sum;
  }
  __syncthreads();
  const T* b = static_cast<const T*>(p.b) + static_cast<int64_t>(slot) * p.ranks * p.n;
  T* out = static_cast<T*>(p.out) + token * p.out_stride;
  const int rank = p.ranks / p.num_parts;
  const float scale = p.scale[slot];
  int part = 0;
  for (int64_t c = threadIdx.x; c < p.n; c += kThreads) {
    while (c >= p.part_columns[part + 1]) ++part;  // (columns ascend along the loop)
    float delta = 0.0f;
    for (int r = part * rank; r < (part + 1) * rank; ++r) {
      delta += shrunk[r] * to_float(b[static_cast<int64_t>(r) * p.n + c]);
    }
    out[c] = from_float<T>(to_float(out[c]) + delta * scale);
  }
}

}  // namespace pyengine::cuda::lora_kernels
