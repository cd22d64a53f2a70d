// Argument checks shared by the attention kernels' glue. Internal to pyengine_core.
#pragma once

#include <string>

#include "pyengine/errors.h"
#include "pyengine/tensor_view.h"

namespace pyengine::detail {

inline std::string arg(const char* op, const char* name) { return std::string(op) + ": " + name; }

inline void check_cpu(const TensorView& t, const char* op, const char* name) {
  if (t.device.kind != DeviceKind::kCPU) {
    throw InvalidArgument(arg(op, name) + " is on " + device_name(t.device) +
                          "; this kernel runs on the CPU (the CUDA one comes with the CUDA "
                          "backend)");
  }
}

inline void check_shape(const TensorView& t, const char* op, const char* name, int ndim) {
  if (t.ndim != ndim) {
    throw InvalidArgument(arg(op, name) + " must have " + std::to_string(ndim) + " dims, got " +
                          t.describe());
  }
}

inline void check_dtype(const TensorView& t, DType dtype, const char* op, const char* name) {
  if (t.dtype != dtype) {
    throw InvalidArgument(arg(op, name) + " must be " + dtype_name(dtype) + ", got " +
                          t.describe());
  }
}

inline bool is_cache_dtype(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16;
}

// A KV cache [num_blocks, num_kv_heads, block_size, head_size], dense.
inline void check_cache(const TensorView& c, const char* op, const char* name) {
  check_cpu(c, op, name);
  check_shape(c, op, name, 4);
  if (!c.is_contiguous()) throw InvalidArgument(arg(op, name) + " must be dense, got strides");
  if (!is_cache_dtype(c.dtype)) {
    throw InvalidArgument(arg(op, name) + " must be float32, float16 or bfloat16, got " +
                          c.describe());
  }
  const int64_t block_size = c.shape[2];
  if (block_size <= 0 || (block_size & (block_size - 1)) != 0) {
    throw InvalidArgument(arg(op, name) + ": block_size (dim 2) must be a power of two, got " +
                          c.describe());
  }
}

inline void check_same_cache(const TensorView& a, const TensorView& b, const char* op) {
  if (a.dtype != b.dtype || a.shape != b.shape || a.ndim != b.ndim) {
    throw InvalidArgument(std::string(op) + ": value_cache " + b.describe() +
                          " differs from key_cache " + a.describe());
  }
}

}  // namespace pyengine::detail
