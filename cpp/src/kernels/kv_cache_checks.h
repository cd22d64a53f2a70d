// Checks of a paged KV cache pair and of the tensors that go with it (query and out, or
// new keys and values), shared by the glue of the attention and cache-write kernels,
// CPU and CUDA alike. A uint8 cache holds fp8 e4m3 bytes (float_convert.h's kFp8Cache),
// an int8 one int8 values and a float32 scale per row (kInt8Cache). Internal to
// pyengine_core.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
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

// A step's requests as the attention kernels take them: block_tables int32 [num_reqs,
// max_blocks], seq_lens int32 [num_reqs] and query_start_loc int32 [num_reqs + 1], each
// contiguous on `device`. Returns num_reqs.
inline int64_t check_request_arrays(const TensorView& block_tables, const TensorView& seq_lens,
                                    const TensorView& query_start_loc, const Device& device,
                                    const char* op) {
  for (const auto& [t, name, ndim] : {std::tuple{&block_tables, "block_tables", 2},
                                      std::tuple{&seq_lens, "seq_lens", 1},
                                      std::tuple{&query_start_loc, "query_start_loc", 1}}) {
    check_device(*t, device, op, name);
    check_dtype(*t, DType::kInt32, op, name);
    check_shape(*t, op, name, ndim);
    if (!t->is_contiguous()) throw InvalidArgument(arg(op, name) + " must be contiguous");
  }
  const int64_t num_reqs = seq_lens.shape[0];
  if (query_start_loc.shape[0] != num_reqs + 1 || block_tables.shape[0] != num_reqs) {
    throw InvalidArgument(std::string(op) +
                          ": need seq_lens [num_reqs], query_start_loc [num_reqs + 1] and "
                          "block_tables [num_reqs, max_blocks]");
  }
  return num_reqs;
}

// Their values, on the CPU: query_start_loc from 0 to num_tokens, each request's query
// tokens at most its seq_len, its blocks within its table's row, and each entry from
// first_block(its first query's position) to its last block a block of the cache
// (entries before it are never read: a window's KV-cache group may have released them).
template <typename FirstBlock>
void check_request_values(const TensorView& block_tables, const TensorView& seq_lens,
                          const TensorView& query_start_loc, int64_t num_tokens,
                          int64_t block_size, int64_t num_blocks, const char* op,
                          FirstBlock first_block) {
  const int64_t num_reqs = seq_lens.shape[0], max_blocks = block_tables.shape[1];
  const auto* qsl = static_cast<const int32_t*>(query_start_loc.data);
  const auto* lens = static_cast<const int32_t*>(seq_lens.data);
  const auto* tables = static_cast<const int32_t*>(block_tables.data);
  if (qsl[0] != 0 || qsl[num_reqs] != num_tokens) {
    throw InvalidArgument(std::string(op) + ": query_start_loc must start at 0 and end at " +
                          std::to_string(num_tokens));
  }
  for (int64_t i = 0; i < num_reqs; ++i) {
    const int64_t q_len = qsl[i + 1] - qsl[i];
    if (q_len < 0 || lens[i] < q_len) {
      throw InvalidArgument(std::string(op) + ": request " + std::to_string(i) + " has " +
                            std::to_string(q_len) + " query tokens and seq_len " +
                            std::to_string(lens[i]) + " (need 0 <= q_len <= seq_len)");
    }
    const int64_t num_used = (lens[i] + block_size - 1) / block_size;
    if (num_used > max_blocks) {
      throw InvalidArgument(std::string(op) + ": request " + std::to_string(i) + " needs " +
                            std::to_string(num_used) + " blocks, block_tables has " +
                            std::to_string(max_blocks) + " per request");
    }
    for (int64_t b = first_block(lens[i] - q_len); b < num_used; ++b) {
      const int32_t block = tables[i * max_blocks + b];
      if (block < 0 || block >= num_blocks) {
        throw InvalidArgument(std::string(op) + ": block_tables[" + std::to_string(i) + ", " +
                              std::to_string(b) + "] = " + std::to_string(block) +
                              " is outside [0, " + std::to_string(num_blocks) + ")");
      }
    }
  }
}

}  // namespace pyengine::detail
