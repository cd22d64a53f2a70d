// Tensors from any framework through the DLPack protocol (__dlpack__), as TensorViews.
// The structs below follow the DLPack ABI (v0.8 "dltensor" capsules), which torch,
// numpy, JAX and CuPy all export; pyengine_core itself never sees them.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

#include "pyengine/tensor_view.h"

namespace pyengine::bindings {

namespace dlpack {
struct Device {
  int32_t device_type;  // 1 CPU, 2 CUDA, 3 CUDA host (pinned)
  int32_t device_id;
};
struct DataType {
  uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat
  uint8_t bits;
  uint16_t lanes;
};
struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null means dense row-major
  uint64_t byte_offset;
};
struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor*);
};
}  // namespace dlpack

// A view that keeps its producer's capsule (and so the memory) alive.
class DLPackView {
 public:
  DLPackView(const pybind11::handle& obj, const std::string& name);
  const TensorView& view() const { return view_; }

 private:
  pybind11::object capsule_;
  TensorView view_;
};

}  // namespace pyengine::bindings
