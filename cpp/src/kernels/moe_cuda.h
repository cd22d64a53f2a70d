// The CUDA branch of moe_softmax_topk (moe_cuda.cpp), which moe.cpp's CPU kernel hands
// CUDA tensors to. Internal to pyengine_core.
#pragma once

#include "pyengine/tensor_view.h"

namespace pyengine::detail {

void moe_softmax_topk_cuda(const TensorView& ids, const TensorView& weights,
                           const TensorView& logits, bool renormalize, void* stream);

}  // namespace pyengine::detail
