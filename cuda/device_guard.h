// Error checks, and a guard that makes a CUDA device current for a scope and restores the caller's
// device after, so that a kernel on cuda:1 leaves torch's current device alone. Internal to cuda/.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace pyengine::cuda {

// Throws std::runtime_error naming the op, the CUDA call and CUDA's error string.
inline void check_cuda(const char* op, cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(op) + " (CUDA): " + what + ": " +
                             cudaGetErrorString(status));
  }
}

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda("pyengine", cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda("pyengine", cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace pyengine::cuda
