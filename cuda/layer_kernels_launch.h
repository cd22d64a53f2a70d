// Host-side launchers of the CUDA fused-layer and cache-write kernels. Plain C++ (no
// CUDA types), so that the device-independent glue in cpp/src/kernels, which checks every
// argument first, can call them. Each runs on `stream` (a cudaStream_t; nullptr: the
// default stream) of the tensors' device, and throws std::runtime_error with the CUDA
// error string when a launch fails.
//
// Values that live on the device are not read back to be checked (that would
// synchronize the host with every step): a position outside the rotary table leaves
// its token unrotated, and a slot outside the cache is skipped, as a negative slot is.
#pragma once

#include "pyengine/tensor_view.h"

namespace pyengine::cuda {

// out = x / sqrt(mean(x^2) + eps) * weight per row.   x, out: [tokens, hidden]
void rms_norm(const TensorView& out, const TensorView& x, const TensorView& weight, float eps,
              void* stream);

// residual += x; x = rms_norm(residual) * weight (the norm of the unrounded sum).
void fused_add_rms_norm(const TensorView& x, const TensorView& residual, const TensorView& weight,
                        float eps, void* stream);

// Rotary embedding in place, rotate-half (is_neox) or interleaved pairs.   query [tokens,
// heads, d], key [tokens, kv_heads, d], positions int32/int64 [tokens], cos_sin_cache
// float32 [max_positions, d]
void rotary_embedding(const TensorView& positions, const TensorView& query, const TensorView& key,
                      const TensorView& cos_sin_cache, bool is_neox, void* stream);

// out = silu(x[:, :n]) * x[:, n:].   x [tokens, 2n], out [tokens, n]
void silu_and_mul(const TensorView& out, const TensorView& x, void* stream);

// Writes each token's key and value into its slot of the paged caches (slot_mapping
// int64 [tokens], negative: skip).   key/value [tokens, kv_heads, d];
// key_cache [blocks, kv_heads, d, block_size]; value_cache [blocks, kv_heads, block_size, d]
// in key's dtype, or 8-bit under float16/bfloat16 K/V (cache_8bit.cuh: fp8 e4m3 as uint8,
// with k_scale/v_scale > 0 its static divisors; int8, its head dims 4 longer for the
// scale, static where k_scale/v_scale > 0).
void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping, float k_scale,
                       float v_scale, void* stream);

}  // namespace pyengine::cuda
