// Host-side launcher of the CUDA block-content hash. Plain C++ (no CUDA types), called by
// cpp/src/core/prefix_hash.cpp after it has checked the arguments.
#pragma once

#include <cstdint>

namespace pyengine::cuda {

// out[b] = xxHash64 of tokens[b * block_size, (b + 1) * block_size) (as bytes) with
// `seed`, for b < num_blocks; device pointers, on `stream` (a cudaStream_t; nullptr: the
// default stream). Throws std::runtime_error with the CUDA error string on a failed launch.
void block_content_hashes(const int32_t* tokens, int64_t num_blocks, int block_size, uint64_t seed,
                          uint64_t* out, int device_index, void* stream);

}  // namespace pyengine::cuda
