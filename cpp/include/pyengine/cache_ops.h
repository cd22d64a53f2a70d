// Cache operations on the paged KV cache, dispatched on the tensors' device.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "pyengine/tensor_view.h"

namespace pyengine {

// Whether this build compiled the CUDA kernels in cuda/.
bool built_with_cuda();

// For every row (src, dst) of block_mapping, block dst of every cache becomes a copy of
// block src (copy-on-write, see KVCacheManager::take_pending_copies).
//   caches:        one or more tensors [num_blocks, ...] (a layer's keys or values), all
//                  of one dtype, device, num_blocks and block size (keys and values may
//                  differ in layout); dims after the first dense
//   block_mapping: int64 [num_pairs, 2] on the CPU, every id in [0, num_blocks)
//   stream:        cudaStream_t for CUDA caches (nullptr: the default stream); unused
//                  on the CPU
// The result is that of applying the pairs one after another, in order (a block may be
// the destination of one pair and the source of a later one).
// Throws InvalidArgument naming the argument on any mismatch, before copying anything.
void copy_blocks(std::span<const TensorView> caches, const TensorView& block_mapping,
                 void* stream = nullptr);

// For every row (s, d) of block_mapping, block d of `dst` becomes a copy of block s of
// `src` (moving blocks between two caches: to a host pool and back, for swapping).
//   src, dst:      [num_blocks, ...] of one dtype and block size; dims after the first
//                  dense; each on the CPU or one CUDA device (host memory pinned for
//                  the copies to run asynchronously on `stream`; synchronize it before
//                  reading blocks that arrive in host memory)
//   block_mapping: int64 [num_pairs, 2] on the CPU, s < src's and d < dst's num_blocks
// Throws InvalidArgument naming the argument, before copying anything.
void swap_blocks(const TensorView& src, const TensorView& dst, const TensorView& block_mapping,
                 void* stream = nullptr);

// The wave of each (src, dst) pair of `pairs` ([num_pairs * 2]): pairs of one wave touch
// no block another pair of that wave writes, so a wave may run in parallel, and running
// the waves in order gives the same result as running the pairs in order. A pair waits
// for every earlier pair that writes its src or dst, or reads its dst.
std::vector<int> copy_block_waves(std::span<const int64_t> pairs);

}  // namespace pyengine
