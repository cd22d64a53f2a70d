// Launchers of the mixture-of-experts kernels (see moe_launch.h; the kernels are in
// moe_kernels.cuh): each picks the element type.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cuda/element_types.cuh"
#include "cuda/moe_kernels.cuh"
#include "cuda/moe_launch.h"
#include "cuda/runtime_guards.h"

namespace pyengine::cuda {
namespace {

using namespace moe_kernels;  // NOLINT(google-build-using-namespace): this file's kernels

cudaStream_t as_cuda(void* stream) { return static_cast<cudaStream_t>(stream); }

// f(T{}) for a 16-bit dtype (the grouped products have no float32 tensor-core mma).
template <class F>
void for_16_bits(DType dtype, const char* op, F&& f) {
  for_dtype(dtype, op, [&](auto zero) {
    if constexpr (std::is_same_v<decltype(zero), float>) {
      throw std::invalid_argument(std::string(op) + " (CUDA): float16 or bfloat16 only");
    } else {
      f(zero);
    }
  });
}

}  // namespace

void moe_softmax_topk(const TensorView& ids, const TensorView& weights, const TensorView& logits,
                      bool renormalize, void* stream) {
  const int rows = static_cast<int>(logits.shape[0]), experts = static_cast<int>(logits.shape[1]);
  if (rows == 0) return;
  const DeviceGuard guard(logits.device.index);
  const dim3 grid((rows + kTopkWarps - 1) / kTopkWarps);
  for_dtype(logits.dtype, "moe_softmax_topk", [&](auto zero) {
    using T = decltype(zero);
    softmax_topk_kernel<T><<<grid, kTopkWarps * kWarp, 0, as_cuda(stream)>>>(
        static_cast<int32_t*>(ids.data), static_cast<float*>(weights.data),
        static_cast<const T*>(logits.data), logits.strides[0], rows, experts,
        static_cast<int>(ids.shape[1]), renormalize);
  });
  check_cuda("moe_softmax_topk", cudaGetLastError(), "kernel launch");
}

void moe_align_blocks(const TensorView& sorted, const TensorView& block_experts,
                      const TensorView& ids, int first_expert, int experts, void* stream) {
  const int slots = static_cast<int>(ids.shape[0] * ids.shape[1]);
  const int max_blocks = static_cast<int>(block_experts.shape[0]);
  if (max_blocks == 0) return;
  const DeviceGuard guard(ids.device.index);
  align_kernel<<<1, kAlignThreads, 0, as_cuda(stream)>>>(
      static_cast<int32_t*>(sorted.data), static_cast<int32_t*>(block_experts.data),
      static_cast<const int32_t*>(ids.data), slots, first_expert, experts, max_blocks);
  check_cuda("moe_align_blocks", cudaGetLastError(), "kernel launch");
}

void moe_expert_gemm(const TensorView& out, const TensorView& x, const TensorView& w,
                     const TensorView& sorted, const TensorView& block_experts,
                     const TensorView& weights, int top_k, bool gate_up, bool on_input,
                     void* stream) {
  const auto max_blocks = static_cast<unsigned>(block_experts.shape[0]);
  if (max_blocks == 0) return;
  ExpertGemmParams p{};
  p.out = out.data;
  p.x = x.data;
  p.w = w.data;
  p.sorted = static_cast<const int32_t*>(sorted.data);
  p.block_experts = static_cast<const int32_t*>(block_experts.data);
  p.weights = static_cast<const float*>(weights.data);
  p.out_stride = out.strides[0];
  p.x_stride = x.strides[0];
  p.n = static_cast<int>(out.shape[1]);
  p.k = static_cast<int>(x.shape[1]);
  p.top_k = top_k;
  p.on_input = on_input;
  const DeviceGuard guard(x.device.index);
  const dim3 grid((p.n + kWarps * kTileColumns - 1) / (kWarps * kTileColumns), max_blocks);
  for_16_bits(x.dtype, "moe_expert_gemm", [&](auto zero) {
    using T = decltype(zero);
    if (gate_up) {
      expert_gemm_kernel<T, true><<<grid, kWarps * kWarp, 0, as_cuda(stream)>>>(p);
    } else {
      expert_gemm_kernel<T, false><<<grid, kWarps * kWarp, 0, as_cuda(stream)>>>(p);
    }
  });
  check_cuda("moe_expert_gemm", cudaGetLastError(), "kernel launch");
}

void moe_combine(const TensorView& out, const TensorView& y, const TensorView& ids,
                 int first_expert, int experts, void* stream) {
  const auto rows = static_cast<unsigned>(out.shape[0]);
  if (rows == 0) return;
  const DeviceGuard guard(out.device.index);
  for_16_bits(out.dtype, "moe_combine", [&](auto zero) {
    using T = decltype(zero);
    combine_kernel<T><<<rows, kCombineThreads, 0, as_cuda(stream)>>>(
        static_cast<T*>(out.data), out.strides[0], static_cast<const float*>(y.data),
        y.strides[0], static_cast<const int32_t*>(ids.data), static_cast<int>(ids.shape[1]),
        first_expert, experts, static_cast<int>(out.shape[1]));
  });
  check_cuda("moe_combine", cudaGetLastError(), "kernel launch");
}

}  // namespace pyengine::cuda
