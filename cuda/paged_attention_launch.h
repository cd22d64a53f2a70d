// Host-side launcher of the CUDA paged-attention kernel. Plain C++ (no CUDA types), so
// that the glue in cpp/src/kernels/paged_attention.cpp, which checks shapes, dtypes and devices
// first, can call it.
#pragma once

#include "pyengine/attention.h"

namespace pyengine::cuda {

// The contract of pyengine::paged_attention (pyengine/attention.h), on `stream` (a
// cudaStream_t; nullptr: the default stream) of the tensors' CUDA device. The metadata
// (block_tables, seq_lens, query_start_loc) stay on the device and are not read back to
// be checked; a block id outside the cache is read as block 0 rather than out of bounds.
// Throws std::runtime_error with the CUDA error string when a launch fails.
void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables,
                     const TensorView& seq_lens, const TensorView& query_start_loc,
                     const AttentionOptions& options, void* stream);

}  // namespace pyengine::cuda
