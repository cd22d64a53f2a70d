// Checks of the tensors a kernel's glue is given (its device, dims, dtype, strides and
// index values), each throwing InvalidArgument with a message that names the op and the
// argument. Shared by the glue of every kernel, CPU and CUDA alike; the checks of a KV
// cache pair are in kv_cache_checks.h. Internal to pyengine_core.
#pragma once

#include <cstdint>
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

// Element i of a 1-d int32 or int64 view (token ids, positions), as int64.
inline int64_t index_at(const TensorView& t, int64_t i) {
  const int64_t at = i * t.strides[0];
  return t.dtype == DType::kInt32 ? static_cast<const int32_t*>(t.data)[at]
                                  : static_cast<const int64_t*>(t.data)[at];
}

// Every element of the 1-d int32/int64 view `ids` in [0, bound), or an error naming the
// first that is not.
inline void check_indices(const TensorView& ids, int64_t bound, const char* op, const char* name) {
  for (int64_t i = 0; i < ids.shape[0]; ++i) {
    const int64_t v = index_at(ids, i);
    if (v < 0 || v >= bound) {
      throw InvalidArgument(std::string(op) + ": " + name + "[" + std::to_string(i) + "] is " +
                            std::to_string(v) + ", outside [0, " + std::to_string(bound) + ")");
    }
  }
}

// For ops with a CUDA build: whether their tensors (checked to agree) are on a CUDA
// device, where that build runs them. Throws where pyengine was built without CUDA.
inline bool on_cuda(const Device& device, const char* op) {
  if (device.kind != DeviceKind::kCUDA) return false;
#ifndef PYENGINE_WITH_CUDA
  throw InvalidArgument(std::string(op) + ": the tensors are on " + device_name(device) +
                        " but pyengine was built without CUDA (PYENGINE_CUDA=off or no nvcc)");
#else
  (void)op;
#endif
  return true;
}

// For ops with a CUDA build: t must be on `device`, the device of the op's first tensor.
inline void check_device(const TensorView& t, const Device& device, const char* op,
                         const char* name) {
  if (t.device != device) {
    throw InvalidArgument(arg(op, name) + " is on " + device_name(t.device) +
                          "; the op's tensors must all be on " + device_name(device));
  }
}

// A [tokens, ...] tensor of `ndim` dims and `dtype` on `device` with a dense last dim
// (and, with 3 dims, dense heads: [tokens, heads, d] rows).
inline void check_rows_on(const TensorView& t, const Device& device, const char* op,
                          const char* name, int ndim, DType dtype) {
  check_device(t, device, op, name);
  check_shape(t, op, name, ndim);
  check_dtype(t, dtype, op, name);
  // (A dim of size 1 may have any stride: torch calls such a tensor contiguous.)
  if (t.strides[ndim - 1] != 1 && t.shape[ndim - 1] > 1) {
    throw InvalidArgument(arg(op, name) + " needs a dense last dim");
  }
  if (ndim == 3 && t.strides[1] != t.shape[2] && t.shape[1] > 1) {
    throw InvalidArgument(arg(op, name) + " must have dense heads ([tokens, heads, d] rows)");
  }
}

// A tensor an op writes: no two of its elements may share memory (a stride of 0, as
// torch's `expand` makes, would have them written as one).
inline void check_writable(const TensorView& t, const char* op, const char* name) {
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] > 1 && t.strides[d] == 0) {
      throw InvalidArgument(arg(op, name) + " is written, but its elements share memory (" +
                            t.describe() + ")");
    }
  }
}

// The same on the CPU.
inline void check_rows(const TensorView& t, const char* op, const char* name, int ndim,
                       DType dtype) {
  check_cpu(t, op, name);
  check_rows_on(t, Device{}, op, name, ndim, dtype);
}

// x and out float32 rows, out [m, n] for x [m, k] (a matmul's operands).
inline void check_x_out(const char* op, const TensorView& out, const TensorView& x, int64_t n) {
  check_rows(x, op, "x", 2, DType::kFloat32);
  check_rows(out, op, "out", 2, DType::kFloat32);
  check_writable(out, op, "out");
  if (out.shape[0] != x.shape[0] || out.shape[1] != n) {
    throw InvalidArgument(std::string(op) + ": out must be [" + std::to_string(x.shape[0]) + ", " +
                          std::to_string(n) + "], got " + out.describe());
  }
}

// A dense float32 [n] on the CPU (a bias, a scale per output).
inline void check_vector(const TensorView& t, const char* op, const char* name, int64_t n) {
  check_cpu(t, op, name);
  if (t.ndim != 1 || t.shape[0] != n || t.dtype != DType::kFloat32 || t.strides[0] != 1) {
    throw InvalidArgument(arg(op, name) + " must be dense float32 [" + std::to_string(n) +
                          "], got " + t.describe());
  }
}

}  // namespace pyengine::detail
