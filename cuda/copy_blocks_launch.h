// Host-side launchers of the CUDA cache kernels. Plain C++ (no CUDA types), so that the
// device-independent glue in cpp/src/kernels can call them; arguments are checked there.
#pragma once

#include <cstdint>

namespace pyengine::cuda {

// Copies `block_bytes` bytes from block src to block dst of every cache, one wave after
// another (the pairs of a wave run in parallel; see pyengine::copy_block_waves).
//   cache_bases:   [num_caches] device pointers to block 0 of each cache
//   block_stride:  bytes between consecutive blocks of a cache (the same for all)
//   block_mapping: [num_pairs, 2] (src, dst) host array sorted by wave, range-checked
//   wave_starts:   [num_waves + 1] row offsets of the waves in block_mapping
// Throws std::runtime_error with the CUDA error string on a failed launch.
void copy_blocks(void* const* cache_bases, int64_t num_caches, int64_t block_stride,
                 int64_t block_bytes, const int64_t* block_mapping, const int64_t* wave_starts,
                 int num_waves, int device_index, void* stream);

// For each pair (s, d) of block_mapping (a host array, range-checked), copies block s of
// `src` to block d of `dst` (block_bytes each; strides in bytes), between a device and
// host memory in either direction or within a device, with cudaMemcpyAsync on `stream`
// (asynchronous where the host memory is pinned: synchronize the stream before reading
// what arrives there).
void swap_blocks(const void* src, int64_t src_stride, void* dst, int64_t dst_stride,
                 int64_t block_bytes, const int64_t* block_mapping, int64_t num_pairs,
                 int device_index, void* stream);

}  // namespace pyengine::cuda
