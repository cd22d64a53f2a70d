// A dense TensorView over a test's own buffer, for the C++ tests.
#pragma once

#include <cstdint>
#include <vector>

#include "pyengine/tensor_view.h"

namespace pyengine::testing {

// `data` as a dense [dims...] tensor of `dtype` on the CPU.
inline TensorView view(void* data, DType dtype, std::vector<int64_t> dims) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.ndim = static_cast<int>(dims.size());
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.shape[static_cast<size_t>(d)] = dims[static_cast<size_t>(d)];
    v.strides[static_cast<size_t>(d)] = stride;
    stride *= dims[static_cast<size_t>(d)];
  }
  return v;
}

}  // namespace pyengine::testing
