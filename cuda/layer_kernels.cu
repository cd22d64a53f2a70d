// Launchers of the fused layers and the KV-cache write (see layer_kernels_launch.h; the
// kernels are in layer_kernels.cuh): each picks the kernel's element type and pack width.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "cuda/cache_8bit.cuh"
#include "cuda/element_types.cuh"
#include "cuda/layer_kernels.cuh"
#include "cuda/layer_kernels_launch.h"
#include "cuda/runtime_guards.h"

namespace pyengine::cuda {
namespace {

using namespace layer_kernels;  // NOLINT(google-build-using-namespace): this file's kernels

void check_launch(const char* op) { check_cuda(op, cudaGetLastError(), "kernel launch"); }

template <typename T>
T* typed(const TensorView& t) {
  return static_cast<T*>(t.data);
}

}  // namespace

void rms_norm(const TensorView& out, const TensorView& x, const TensorView& weight, float eps,
              void* stream) {
  const int64_t rows = x.shape[0];
  const int n = static_cast<int>(x.shape[1]);
  if (rows == 0) return;
  const DeviceGuard guard(x.device.index);
  for_dtype(x.dtype, "rms_norm", [&](auto zero) {
    using T = decltype(zero);
    with_pack_width<T>(
        {out.data, x.data, weight.data}, {n, out.strides[0], x.strides[0]}, [&](auto width) {
          constexpr int W = decltype(width)::value;
          rms_norm_kernel<T, W><<<static_cast<unsigned>(rows), threads_for(n / W), 0,
                                  static_cast<cudaStream_t>(stream)>>>(
              typed<T>(out), out.strides[0], typed<T>(x), x.strides[0], typed<T>(weight), n, eps);
        });
  });
  check_launch("rms_norm");
}

void fused_add_rms_norm(const TensorView& x, const TensorView& residual, const TensorView& weight,
                        float eps, void* stream) {
  const int64_t rows = x.shape[0];
  const int n = static_cast<int>(x.shape[1]);
  if (rows == 0) return;
  const DeviceGuard guard(x.device.index);
  for_dtype(x.dtype, "fused_add_rms_norm", [&](auto zero) {
    using T = decltype(zero);
    with_pack_width<T>({x.data, residual.data, weight.data}, {n, x.strides[0], residual.strides[0]},
                       [&](auto width) {
                         constexpr int W = decltype(width)::value;
                         fused_add_rms_norm_kernel<T, W>
                             <<<static_cast<unsigned>(rows), threads_for(n / W), 0,
                                static_cast<cudaStream_t>(stream)>>>(
                                 typed<T>(x), x.strides[0], typed<T>(residual), residual.strides[0],
                                 typed<T>(weight), n, eps);
                       });
  });
  check_launch("fused_add_rms_norm");
}

void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView& cos_sin_cache, bool is_neox, void* stream) {
  const int64_t tokens = query.shape[0];
  if (tokens == 0) return;
  const int num_heads = static_cast<int>(query.shape[1]),
            num_kv_heads = static_cast<int>(key.shape[1]);
  const int d = static_cast<int>(query.shape[2]);
  const DeviceGuard guard(query.device.index);
  for_dtype(query.dtype, "rotary_embedding", [&](auto zero) {
    using T = decltype(zero);
    // Heads lie d elements apart (the glue checks it); a thread's packs start at
    // multiples of W from the head (d / 2 + i0 rotate-half).
    with_pack_width<
        T>({query.data, key.data}, {d / 2, query.strides[0], key.strides[0]}, [&](auto width) {
      constexpr int W = decltype(width)::value;
      const auto launch = [&](const auto* pos) {
        rotary_kernel<T, std::remove_cv_t<std::remove_pointer_t<decltype(pos)>>, W>
            <<<static_cast<unsigned>(tokens), threads_for((num_heads + num_kv_heads) * d / 2 / W),
               0, static_cast<cudaStream_t>(stream)>>>(
                pos, positions.strides[0], typed<T>(query), query.strides[0], num_heads,
                typed<T>(key), key.strides[0], num_kv_heads, d,
                static_cast<const float*>(cos_sin_cache.data), cos_sin_cache.strides[0],
                cos_sin_cache.shape[0], is_neox);
      };
      if (positions.dtype == DType::kInt32) {
        launch(static_cast<const int32_t*>(positions.data));
      } else {
        launch(static_cast<const int64_t*>(positions.data));
      }
    });
  });
  check_launch("rotary_embedding");
}

void silu_and_mul(const TensorView& out, const TensorView& x, void* stream) {
  const int64_t rows = out.shape[0], n = out.shape[1];
  if (rows * n == 0) return;
  const DeviceGuard guard(x.device.index);
  constexpr int kThreads = 256;
  for_dtype(x.dtype, "silu_and_mul", [&](auto zero) {
    using T = decltype(zero);
    with_pack_width<T>({out.data, x.data}, {n, out.strides[0], x.strides[0]}, [&](auto width) {
      constexpr int W = decltype(width)::value;
      const int64_t chunks = (n / W + kThreads - 1) / kThreads;
      if (chunks > 65535) throw std::invalid_argument("silu_and_mul (CUDA): rows are too long");
      const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(chunks));
      silu_and_mul_kernel<T, W><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          typed<T>(out), out.strides[0], typed<T>(x), x.strides[0], n);
    });
  });
  check_launch("silu_and_mul");
}

namespace {

// An 8-bit cache's write: a warp per (token, kv head).
void reshape_and_cache_8bit(const TensorView& key, const TensorView& value,
                            const TensorView& key_cache, const TensorView& value_cache,
                            const TensorView& slot_mapping, float k_scale, float v_scale,
                            void* stream) {
  const int64_t tokens = key.shape[0];
  const int num_kv_heads = static_cast<int>(value_cache.shape[1]);
  const int block_size = static_cast<int>(value_cache.shape[2]);
  const int head_size = static_cast<int>(key.shape[2]);
  for_16bit_dtype(key.dtype, "reshape_and_cache", [&](auto zero) {
    using T = decltype(zero);
    for_8bit_cache(key_cache.dtype, "reshape_and_cache", [&](auto element) {
      using C = decltype(element);
      const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>(num_kv_heads));
      reshape_and_cache_8bit_kernel<T, C><<<grid, kWarp, 0, static_cast<cudaStream_t>(stream)>>>(
          typed<T>(key), key.strides[0], key.strides[1], typed<T>(value), value.strides[0],
          value.strides[1], typed<C>(key_cache), typed<C>(value_cache),
          static_cast<const int64_t*>(slot_mapping.data), slot_mapping.strides[0], num_kv_heads,
          head_size, block_size, value_cache.shape[0] * static_cast<int64_t>(block_size), k_scale,
          v_scale);
    });
  });
}

}  // namespace

void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping, float k_scale,
                       float v_scale, void* stream) {
  const int64_t tokens = key.shape[0];
  if (tokens == 0) return;
  const DeviceGuard guard(key.device.index);
  if (is_8bit_cache(key_cache.dtype)) {
    reshape_and_cache_8bit(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                           stream);
    check_launch("reshape_and_cache");
    return;
  }
  const int num_kv_heads = static_cast<int>(key_cache.shape[1]);
  const int head_size = static_cast<int>(key_cache.shape[2]);
  const int block_size = static_cast<int>(key_cache.shape[3]);
  for_dtype(key_cache.dtype, "reshape_and_cache", [&](auto zero) {
    using T = decltype(zero);
    with_pack_width<T>(
        {key.data, value.data, value_cache.data},
        {head_size, key.strides[0], key.strides[1], value.strides[0], value.strides[1]},
        [&](auto width) {
          constexpr int W = decltype(width)::value;
          reshape_and_cache_kernel<T, W>
              <<<static_cast<unsigned>(tokens), threads_for(num_kv_heads * head_size / W), 0,
                 static_cast<cudaStream_t>(stream)>>>(
                  typed<T>(key), key.strides[0], key.strides[1], typed<T>(value), value.strides[0],
                  value.strides[1], typed<T>(key_cache), typed<T>(value_cache),
                  static_cast<const int64_t*>(slot_mapping.data), slot_mapping.strides[0],
                  num_kv_heads, head_size, block_size,
                  key_cache.shape[0] * static_cast<int64_t>(block_size));
        });
  });
  check_launch("reshape_and_cache");
}

}  // namespace pyengine::cuda
