// Launcher of the block-quantized GEMM (see block_gemm_launch.h; the kernel is in
// block_gemm.cuh): picks the element type and the weights' bits.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "cuda/block_gemm.cuh"
#include "cuda/block_gemm_launch.h"
#include "cuda/element_types.cuh"
#include "cuda/runtime_guards.h"

namespace pyengine::cuda {

void block_gemm(const TensorView& out, const TensorView& x, const TensorView& packed,
                const TensorView& scale, const TensorView& offset, const TensorView& bias,
                int bits, int group, void* stream) {
  using namespace block_gemm_kernels;  // NOLINT(google-build-using-namespace): this file's kernel
  const int m = static_cast<int>(x.shape[0]), k = static_cast<int>(x.shape[1]);
  const int n = static_cast<int>(out.shape[1]);
  if (m == 0 || n == 0) return;
  const DeviceGuard guard(x.device.index);
  const dim3 grid((n + kWarps * kTileColumns - 1) / (kWarps * kTileColumns),
                  (m + kTileRows - 1) / kTileRows);
  const auto* b = static_cast<const float*>(bias.data);
  const auto run = [&](auto zero, auto width) {
    using T = decltype(zero);
    constexpr int kBits = decltype(width)::value;
    block_gemm_kernel<T, kBits><<<grid, kWarps * kWarp, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(out.data), out.strides[0], static_cast<const T*>(x.data), x.strides[0],
        static_cast<const uint8_t*>(packed.data), static_cast<const float*>(scale.data),
        static_cast<const float*>(offset.data), b, m, n, k, group);
  };
  for_dtype(x.dtype, "block_gemm", [&](auto zero) {
    using T = decltype(zero);
    if constexpr (std::is_same_v<T, float>) {
      throw std::invalid_argument("block_gemm (CUDA): x must be float16 or bfloat16");
    } else if (bits == 4) {
      run(zero, std::integral_constant<int, 4>{});
    } else {
      run(zero, std::integral_constant<int, 8>{});
    }
  });
  check_cuda("block_gemm", cudaGetLastError(), "kernel launch");
}

}  // namespace pyengine::cuda
