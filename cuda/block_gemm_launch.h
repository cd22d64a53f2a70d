// Host-side launcher of the block-quantized GEMM (block_gemm.cuh). Plain C++, called by
// the glue in cpp/src/kernels/block_gemm.cpp once it has checked every argument.
#pragma once

#include "pyengine/tensor_view.h"

namespace pyengine::cuda {

void block_gemm(const TensorView& out, const TensorView& x, const TensorView& packed,
                const TensorView& scale, const TensorView& offset, const TensorView& bias,
                int bits, int group, void* stream);

}  // namespace pyengine::cuda
