// Host-side launcher of the CUDA batched LoRA kernel (cuda/lora_kernels.cuh). Plain C++
// (no CUDA types), so that the device-independent glue in cpp/src/kernels, which checks
// every argument first, can call it. Slots are not read back to be checked: one outside
// [0, num_slots) counts as no adapter.
#pragma once

#include "pyengine/tensor_view.h"

namespace pyengine::cuda {

// The most stacked parts and ranks (parts x rank) of a layer the kernel takes.
inline constexpr int kLoRAMaxParts = 8;
inline constexpr int kLoRAMaxRanks = 1024;

// As pyengine::lora_add (cpp/include/pyengine/lora.h), the tensors on one CUDA device
// but part_columns (on the CPU), on `stream`.
void lora_add(const TensorView& out, const TensorView& x, const TensorView& a, const TensorView& b,
              const TensorView& slots, const TensorView& scale, const TensorView& part_columns,
              void* stream);

}  // namespace pyengine::cuda
