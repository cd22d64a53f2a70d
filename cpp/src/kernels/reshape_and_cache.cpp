#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "float_convert.h"
#include "kv_cache_checks.h"
#include "pyengine/attention.h"
#include "tensor_checks.h"
#ifdef PYENGINE_WITH_CUDA
#include "cuda/layer_kernels_launch.h"
#endif

namespace pyengine {

using detail::arg;

void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping, float k_scale,
                       float v_scale, void* stream) {
  constexpr const char* op = "reshape_and_cache";
  const Device& device = key_cache.device;
  const auto [num_blocks, num_kv_heads, block_size, head_size] =
      detail::check_caches(key_cache, value_cache, op, &device);
  for (const auto& [scale, name] : {std::pair{k_scale, "k_scale"}, std::pair{v_scale, "v_scale"}}) {
    if (!(scale >= 0.0f) || !std::isfinite(scale)) {
      throw InvalidArgument(arg(op, name) + " must be finite and >= 0 (0: a scale per token), " +
                            "got " + std::to_string(scale));
    }
    if (scale > 0.0f && key_cache.dtype != detail::kInt8Cache &&
        key_cache.dtype != detail::kFp8Cache) {
      throw InvalidArgument(arg(op, name) + ": static scales are for int8 and fp8 caches, got " +
                            key_cache.describe());
    }
  }
  const DType input_dtype = detail::input_dtype_for(key, key_cache, op, "key");
  for (const auto& [t, name] : {std::pair{&key, "key"}, std::pair{&value, "value"}}) {
    detail::check_device(*t, device, op, name);
    detail::check_shape(*t, op, name, 3);
    detail::check_dtype(*t, input_dtype, op, name);
    if (t->shape[1] != num_kv_heads || t->shape[2] != head_size || t->strides[2] != 1) {
      throw InvalidArgument(arg(op, name) + " must be [num_tokens, " +
                            std::to_string(num_kv_heads) + ", " + std::to_string(head_size) +
                            "] with a dense last dim, got " + t->describe());
    }
  }
  const int64_t num_tokens = key.shape[0];
  if (value.shape[0] != num_tokens) {
    throw InvalidArgument(std::string(op) + ": key and value differ in num_tokens");
  }
  detail::check_device(slot_mapping, device, op, "slot_mapping");
  detail::check_dtype(slot_mapping, DType::kInt64, op, "slot_mapping");
  if (slot_mapping.ndim != 1 || slot_mapping.shape[0] != num_tokens) {
    throw InvalidArgument(std::string(op) + ": slot_mapping must be int64 [num_tokens], got " +
                          slot_mapping.describe());
  }
  // The slots stay on the device: see cuda/layer_kernels_launch.h.
  if (detail::on_cuda(device, op)) {
#ifdef PYENGINE_WITH_CUDA
    return cuda::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale,
                                   v_scale, stream);
#endif
  }
  (void)stream;
  const auto* slots = static_cast<const int64_t*>(slot_mapping.data);
  const int64_t slot_stride = slot_mapping.strides[0];
  const int64_t num_slots = num_blocks * block_size;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t * slot_stride];
    if (slot < -1 || slot >= num_slots) {
      throw InvalidArgument(std::string(op) + ": slot_mapping[" + std::to_string(t) +
                            "] = " + std::to_string(slot) + " is outside [-1, " +
                            std::to_string(num_slots) + ")");
    }
  }

  const auto element = static_cast<int64_t>(key_cache.element_size());
  const auto row_bytes = static_cast<size_t>(head_size * element);
  const bool converts = input_dtype != key_cache.dtype;  // float32 into a narrower cache
  const DType cache_dtype = key_cache.dtype;
  // One float32 element of `in` into element `index` of the 16-bit or fp8 cache `out`
  // (fp8 with a static scale: x / scale, as vLLM's fp8 caches take a checkpoint's).
  const float k_divisor = k_scale > 0.0f ? k_scale : 1.0f;
  const float v_divisor = v_scale > 0.0f ? v_scale : 1.0f;
  const auto convert = [cache_dtype](const char* in, int64_t in_index, char* out, int64_t index,
                                     float divisor) {
    const float x = detail::load<DType::kFloat32>(in, in_index);
    if (cache_dtype == DType::kBFloat16) {
      detail::store<DType::kBFloat16>(out, index, x);
    } else if (cache_dtype == detail::kFp8Cache) {
      detail::store<detail::kFp8Cache>(out, index, x / divisor);
    } else {
      detail::store<DType::kFloat16>(out, index, x);
    }
  };
  const bool int8_cache = cache_dtype == detail::kInt8Cache;
  // (a checkpoint's static scale was computed for compressed-tensors' [-128, 127])
  const float k_lowest = k_scale > 0.0f ? -128.0f : -127.0f;
  const float v_lowest = v_scale > 0.0f ? -128.0f : -127.0f;
  const int64_t pad = int8_cache ? detail::kInt8ScaleBytes : 0;  // (float_convert.h)
  const int64_t head_stride = block_size * (head_size + pad);    // elements, within a block
  const int64_t block_stride = num_kv_heads * head_stride;
  auto* key_out = static_cast<char*>(key_cache.data);
  auto* value_out = static_cast<char*>(value_cache.data);
  const auto* key_in = static_cast<const char*>(key.data);
  const auto* value_in = static_cast<const char*>(value.data);

  // Runs of tokens in consecutive slots of one block (a prefill's are whole blocks): a
  // run's key columns are written a tile row at a time, not a cache line per element.
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first token, length)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t * slot_stride];
    if (slot < 0) continue;  // padding
    if (!runs.empty()) {
      auto& [first, length] = runs.back();
      const int64_t previous = slots[(t - 1) * slot_stride];
      if (first + length == t && previous >= 0 && slot == previous + 1 && slot % block_size != 0) {
        ++length;
        continue;
      }
    }
    runs.emplace_back(t, 1);
  }
  const auto copy_keys = [&](auto word, int64_t first, int64_t length, int64_t h, char* tile_out) {
    using Word = decltype(word);
    auto* dst = reinterpret_cast<Word*>(tile_out);
    const auto* src =
        reinterpret_cast<const Word*>(key_in) + first * key.strides[0] + h * key.strides[1];
    for (int64_t i = 0; i < head_size; ++i) {
      for (int64_t j = 0; j < length; ++j) dst[i * block_size + j] = src[j * key.strides[0] + i];
    }
  };
  // Scattered decode writes gain from two threads keeping twice as many lines in flight.
  const auto num_runs = static_cast<int64_t>(runs.size());
#pragma omp parallel for schedule(static) if (num_runs * num_kv_heads >= 64)
  for (int64_t r = 0; r < num_runs; ++r) {
    const auto [first, length] = runs[static_cast<size_t>(r)];
    const int64_t slot = slots[first * slot_stride];
    const int64_t block = slot / block_size;
    const int64_t offset = slot % block_size;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t tile = block * block_stride + h * head_stride;  // elements
      if (int8_cache) {
        for (int64_t j = 0; j < length; ++j) {
          const auto* k_row = reinterpret_cast<const float*>(key_in) +
                              (first + j) * key.strides[0] + h * key.strides[1];
          const auto* v_row = reinterpret_cast<const float*>(value_in) +
                              (first + j) * value.strides[0] + h * value.strides[1];
          const int64_t column = offset + j;
          const float k_row_scale =
              k_scale > 0.0f ? k_scale : detail::int8_row_scale(k_row, head_size);
          const float v_row_scale =
              v_scale > 0.0f ? v_scale : detail::int8_row_scale(v_row, head_size);
          auto* k_tile = reinterpret_cast<int8_t*>(key_out) + tile;
          auto* v_out = reinterpret_cast<int8_t*>(value_out) + tile + column * (head_size + pad);
          for (int64_t i = 0; i < head_size; ++i) {
            k_tile[i * block_size + column] =
                detail::int8_quantize(k_row[i], k_row_scale, k_lowest);
            v_out[i] = detail::int8_quantize(v_row[i], v_row_scale, v_lowest);
          }
          std::memcpy(k_tile + head_size * block_size + column * pad, &k_row_scale, sizeof(float));
          std::memcpy(v_out + head_size, &v_row_scale, sizeof(float));
        }
        continue;
      }
      if (converts) {
        for (int64_t j = 0; j < length; ++j) {
          const int64_t k_row = (first + j) * key.strides[0] + h * key.strides[1];
          const int64_t v_row = (first + j) * value.strides[0] + h * value.strides[1];
          for (int64_t i = 0; i < head_size; ++i) {
            convert(value_in, v_row + i, value_out, tile + (offset + j) * head_size + i, v_divisor);
            convert(key_in, k_row + i, key_out, tile + i * block_size + offset + j, k_divisor);
          }
        }
        continue;
      }
      // Values: dense rows, one per token.
      for (int64_t j = 0; j < length; ++j) {
        std::memcpy(value_out + (tile + (offset + j) * head_size) * element,
                    value_in + ((first + j) * value.strides[0] + h * value.strides[1]) * element,
                    row_bytes);
      }
      // Keys: columns offset.. of the transposed tile.
      char* tile_out = key_out + (tile + offset) * element;
      if (element == 4) {
        copy_keys(uint32_t{}, first, length, h, tile_out);
      } else {
        copy_keys(uint16_t{}, first, length, h, tile_out);
      }
    }
  }
}

}  // namespace pyengine
