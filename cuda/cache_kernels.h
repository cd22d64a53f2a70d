// Host-side launchers of the CUDA cache kernels. Plain C++ (no CUDA types), so that the
// device-independent glue in cpp/src can call them; arguments are checked there.
#pragma once

#include <cstdint>

namespace pyengine::cuda {

// Copies `block_bytes` bytes from block src to block dst of every cache.
//   cache_bases:   [num_caches] device pointers to block 0 of each cache
//   block_stride:  bytes between consecutive blocks of a cache
//   block_mapping: [num_pairs, 2] (src, dst) host array, already range-checked
// Throws std::runtime_error with the CUDA error string on a failed launch.
void copy_blocks(void* const* cache_bases, int64_t num_caches, int64_t block_stride,
                 int64_t block_bytes, const int64_t* block_mapping, int64_t num_pairs,
                 int device_index, void* stream);

}  // namespace pyengine::cuda
