// Host-side launcher of the CUDA multi-head latent attention kernel. Plain C++ (no CUDA
// types), so that the glue in cpp/src/kernels/mla_attention.cpp, which checks shapes,
// dtypes and devices first, can call it.
#pragma once

#include <cstdint>

#include "pyengine/tensor_view.h"

namespace pyengine::cuda {

// The contract of pyengine::mla_attention (pyengine/mla.h) on `stream` (a cudaStream_t;
// nullptr: the default stream) of the tensors' CUDA device, the query and cache of one
// dtype (float32, float16, bfloat16), value_dim at most 512 and latent_dim at most 1024.
// The metadata stay on the device and are not read back to be checked; a block id outside
// the cache is read as block 0. Throws std::runtime_error with the CUDA error string when
// a launch fails.
void mla_attention(const TensorView& out, const TensorView& query, const TensorView& latent_cache,
                   const TensorView& block_tables, const TensorView& seq_lens,
                   const TensorView& query_start_loc, float scale, int64_t value_dim,
                   void* stream);

}  // namespace pyengine::cuda
