#include "pyengine/tensor_view.h"

#include <stdexcept>

namespace pyengine {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
    case DType::kInt8: return 1;
    case DType::kFloat8E4M3: return 1;
  }
  throw std::logic_error("dtype_size: unknown dtype");
}

std::string dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kInt8: return "int8";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
  }
  throw std::logic_error("dtype_name: unknown dtype");
}

std::string device_name(const Device& device) {
  return device.kind == DeviceKind::kCPU ? "cpu" : "cuda:" + std::to_string(device.index);
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[static_cast<size_t>(d)];
  return n;
}

bool TensorView::is_contiguous_from(int first_dim) const {
  if (numel() == 0) return true;  // frameworks give empty tensors arbitrary strides
  int64_t expected = 1;
  for (int d = ndim - 1; d >= first_dim; --d) {
    const auto i = static_cast<size_t>(d);
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

std::string TensorView::describe() const {
  std::string s = dtype_name(dtype) + "[";
  for (int d = 0; d < ndim; ++d) {
    if (d > 0) s += ", ";
    s += std::to_string(shape[static_cast<size_t>(d)]);
  }
  return s + "] on " + device_name(device);
}

}  // namespace pyengine
