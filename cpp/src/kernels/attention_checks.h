// Argument checks shared by the kernels' glue. Internal to pyengine_core.
#pragma once

#include <string>

#include "float_convert.h"
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

// (A uint8 cache holds fp8 e4m3 bytes: float_convert.h's kFp8Cache.)
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

inline bool is_cache_dtype(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16 || d == kFp8Cache ||
         d == kInt8Cache;
}

// The dtype that tensors going with `cache` (query and out, or new K/V; `input` is one,
// `name`) must have: the cache's own, or, on the CPU, float32 over a float16/bfloat16
// cache (kv_cache_dtype) where `input` is float32; over an fp8 or int8 cache float32 on
// the CPU, float16 or bfloat16 (input's) on CUDA.
inline DType input_dtype_for(const TensorView& input, const TensorView& cache, const char* op,
                             const char* name) {
  if (cache.dtype == kFp8Cache || cache.dtype == kInt8Cache) {
    if (cache.device.kind == DeviceKind::kCPU) return DType::kFloat32;
    if (input.dtype != DType::kFloat16 && input.dtype != DType::kBFloat16) {
      throw InvalidArgument(arg(op, name) + ": over an fp8 or int8 cache on CUDA it must be " +
                            "float16 or bfloat16, got " + input.describe());
    }
    return input.dtype;
  }
  const bool widened = cache.device.kind == DeviceKind::kCPU && input.dtype == DType::kFloat32 &&
                       cache.dtype != DType::kFloat32;
  return widened ? DType::kFloat32 : cache.dtype;
}

// The shape of a KV cache pair, from value_cache [num_blocks, num_kv_heads, block_size,
// head_size]; key_cache must be [num_blocks, num_kv_heads, head_size, block_size]. (An
// int8 pair's head dims are kInt8ScaleBytes longer: head_size is the values'.)
struct CacheShape {
  int64_t num_blocks, num_kv_heads, block_size, head_size;
};

// On `device` (an op with a CUDA build), or else on the CPU.
inline CacheShape check_caches(const TensorView& key_cache, const TensorView& value_cache,
                               const char* op, const Device* device = nullptr) {
  for (const auto& [c, name] :
       {std::pair{&key_cache, "key_cache"}, std::pair{&value_cache, "value_cache"}}) {
    if (device == nullptr) {
      check_cpu(*c, op, name);
    } else {
      check_device(*c, *device, op, name);
    }
    check_shape(*c, op, name, 4);
    if (!c->is_contiguous()) throw InvalidArgument(arg(op, name) + " must be dense");
    if (!is_cache_dtype(c->dtype)) {
      throw InvalidArgument(arg(op, name) + " must be float32, float16, bfloat16, uint8 (fp8 " +
                            "e4m3 bytes) or int8 (with scales), got " + c->describe());
    }
  }
  const int64_t pad = value_cache.dtype == kInt8Cache ? kInt8ScaleBytes : 0;
  const CacheShape shape{value_cache.shape[0], value_cache.shape[1], value_cache.shape[2],
                         value_cache.shape[3] - pad};
  if (pad > 0 && shape.head_size <= 0) {
    throw InvalidArgument(arg(op, "value_cache") + ": an int8 cache's rows hold head_size " +
                          "values and a float32 scale, [..., block_size, head_size + 4], got " +
                          value_cache.describe());
  }
  if (shape.block_size <= 0 || (shape.block_size & (shape.block_size - 1)) != 0) {
    throw InvalidArgument(arg(op, "value_cache") +
                          ": block_size (dim 2) must be a power of two, got " +
                          value_cache.describe());
  }
  if (shape.num_kv_heads <= 0) {
    throw InvalidArgument(arg(op, "value_cache") +
                          ": num_kv_heads (dim 1) must be at least 1, got " +
                          value_cache.describe());
  }
  const auto& k = key_cache.shape;
  if (key_cache.dtype != value_cache.dtype || k[0] != shape.num_blocks ||
      k[1] != shape.num_kv_heads || k[2] != shape.head_size + pad || k[3] != shape.block_size) {
    throw InvalidArgument(std::string(op) + ": key_cache " + key_cache.describe() +
                          " must be value_cache " + value_cache.describe() +
                          " with its last two dims swapped ([num_blocks, num_kv_heads, "
                          "head_size, block_size]), of the same dtype");
  }
  return shape;
}

}  // namespace pyengine::detail
