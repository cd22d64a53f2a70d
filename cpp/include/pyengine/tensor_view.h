// TensorView: a non-owning view of a strided tensor (data pointer, shape, strides,
// dtype, device). Kernels take these instead of framework tensors, so pyengine_core
// knows neither torch nor Python; the bindings build them from DLPack capsules.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace pyengine {

// kFloat8E4M3: OCP's E4M3FN (torch.float8_e4m3fn), the weights of FP8 checkpoints.
enum class DType : uint8_t {
  kFloat32, kFloat16, kBFloat16, kInt32, kInt64, kUInt8, kInt8, kFloat8E4M3
};
enum class DeviceKind : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceKind kind = DeviceKind::kCPU;
  int index = 0;
  // Spelled out, not defaulted: cuda/ includes this header as C++17.
  friend bool operator==(const Device& a, const Device& b) {
    return a.kind == b.kind && a.index == b.index;
  }
  friend bool operator!=(const Device& a, const Device& b) { return !(a == b); }
};

size_t dtype_size(DType dtype);
std::string dtype_name(DType dtype);
std::string device_name(const Device& device);

struct TensorView {
  static constexpr int kMaxDims = 8;

  void* data = nullptr;  // points at element [0, ..., 0]
  DType dtype = DType::kFloat32;
  Device device;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};  // in elements

  int64_t numel() const;
  size_t element_size() const { return dtype_size(dtype); }
  // Whether dims [first_dim, ndim) are laid out densely in row-major order.
  bool is_contiguous_from(int first_dim) const;
  bool is_contiguous() const { return is_contiguous_from(0); }
  std::string describe() const;  // e.g. "float16[4, 16, 8] on cuda:0"
};

}  // namespace pyengine
