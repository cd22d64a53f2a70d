// The guards every CUDA launcher puts around the CUDA runtime: a check of each call's
// status, a scope that makes a device current, and stream-ordered scratch memory freed
// however the scope is left. Internal to cuda/.
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

// Makes a CUDA device current for its lifetime and restores the caller's device after, so
// that a kernel on cuda:1 leaves torch's current device alone.
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

// Stream-ordered device memory for `op`, freed on the stream however the scope is left
// (both capturable into a CUDA graph).
class StreamBuffer {
 public:
  StreamBuffer(const char* op, size_t bytes, cudaStream_t stream) : stream_(stream) {
    check_cuda(op, cudaMallocAsync(&data_, bytes, stream), "cudaMallocAsync");
  }
  ~StreamBuffer() { cudaFreeAsync(data_, stream_); }
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  unsigned char* data() const { return static_cast<unsigned char*>(data_); }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace pyengine::cuda
