// Launcher of the batched LoRA kernel (see lora_launch.h; the kernel is in lora_kernels.cuh).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/element_types.cuh"
#include "cuda/lora_kernels.cuh"
#include "cuda/lora_launch.h"
#include "cuda/runtime_guards.h"

namespace pyengine::cuda {

void lora_add(const TensorView& out, const TensorView& x, const TensorView& a, const TensorView& b,
              const TensorView& slots, const TensorView& scale, const TensorView& part_columns,
              void* stream) {
  const int64_t tokens = out.shape[0];
  if (tokens == 0) return;
  lora_kernels::LoRAParams p{};
  p.out = out.data;
  p.x = x.data;
  p.a = a.data;
  p.b = b.data;
  p.slots = static_cast<const int32_t*>(slots.data);
  p.scale = static_cast<const float*>(scale.data);
  p.num_parts = static_cast<int>(part_columns.shape[0] - 1);
  const auto* columns = static_cast<const int64_t*>(part_columns.data);
  for (int i = 0; i <= p.num_parts; ++i) p.part_columns[i] = columns[i];
  p.out_stride = out.strides[0];
  p.x_stride = x.strides[0];
  p.n = out.shape[1];
  p.k = x.shape[1];
  p.ranks = static_cast<int>(a.shape[1]);
  p.num_slots = static_cast<int>(a.shape[0]);
  const DeviceGuard guard(out.device.index);
  for_dtype(out.dtype, "lora_add", [&](auto zero) {
    lora_kernels::lora_add_kernel<decltype(zero)>
        <<<static_cast<unsigned>(tokens), lora_kernels::kThreads, 0,
           static_cast<cudaStream_t>(stream)>>>(p);
  });
  check_cuda("lora_add", cudaGetLastError(), "kernel launch");
}

}  // namespace pyengine::cuda
