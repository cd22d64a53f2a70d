// Checks of a paged KV cache pair and of the tensors that go with it (query and out, or
// new keys and values), shared by the glue of the attention and cache-write kernels,
// CPU and CUDA alike. A uint8 cache holds fp8 e4m3 bytes (float_convert.h's kFp8Cache),
// an int8 one int8 values and a float32 scale per row (kInt8Cache). Internal to
// pyengine_core.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "float_convert.h"
#include "pyengine/errors.h"
#include "pyengine/tensor_view.h"
#include "tensor_checks.h"

namespace pyengine::detail {

// Whether a KV cache may hold `d`: the float dtypes, fp8 e4m3 bytes or int8 with scales.
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
