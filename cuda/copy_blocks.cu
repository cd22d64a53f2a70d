// copy_blocks on CUDA: one thread block per (pair, cache), copying 16 bytes per thread
// step when every block starts 16-byte aligned, else one byte per step.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/copy_blocks_launch.h"
#include "cuda/runtime_guards.h"

namespace pyengine::cuda {
namespace {

constexpr int kThreads = 256;

// grid: (num_pairs, num_caches)
template <typename Chunk>
__global__ void copy_blocks_kernel(unsigned char* const* __restrict__ cache_bases,  // [num_caches]
                                   const int64_t* __restrict__ block_mapping,  // [num_pairs, 2]
                                   int64_t block_stride, int64_t num_chunks) {
  const int64_t pair = blockIdx.x;
  unsigned char* base = cache_bases[blockIdx.y];
  const auto* src = reinterpret_cast<const Chunk*>(base + block_mapping[2 * pair] * block_stride);
  auto* dst = reinterpret_cast<Chunk*>(base + block_mapping[2 * pair + 1] * block_stride);
  for (int64_t i = threadIdx.x; i < num_chunks; i += blockDim.x) dst[i] = src[i];
}

}  // namespace

void copy_blocks(void* const* cache_bases, int64_t num_caches, int64_t block_stride,
                 int64_t block_bytes, const int64_t* block_mapping, const int64_t* wave_starts,
                 int num_waves, int device_index, void* stream) {
  const int64_t num_pairs = num_waves > 0 ? wave_starts[num_waves] : 0;
  if (num_pairs == 0 || num_caches == 0 || block_bytes == 0) return;
  if (num_caches > 65535 || num_pairs > 0x7fffffff) {
    throw std::invalid_argument("copy_blocks (CUDA): at most 65535 caches and 2^31-1 pairs");
  }
  const DeviceGuard device_guard(device_index);
  auto s = static_cast<cudaStream_t>(stream);

  // One upload: the cache base pointers, then the mapping.
  const size_t pointer_bytes = static_cast<size_t>(num_caches) * sizeof(void*);
  const size_t mapping_bytes = static_cast<size_t>(num_pairs) * 2 * sizeof(int64_t);
  std::vector<unsigned char> host(pointer_bytes + mapping_bytes);
  std::memcpy(host.data(), cache_bases, pointer_bytes);
  std::memcpy(host.data() + pointer_bytes, block_mapping, mapping_bytes);
  const StreamBuffer device("copy_blocks", host.size(), s);
  // Pageable source: the call returns once `host` is staged, so it may go out of scope.
  check_cuda("copy_blocks",
             cudaMemcpyAsync(device.data(), host.data(), host.size(), cudaMemcpyHostToDevice, s),
             "cudaMemcpyAsync");
  auto* bases = reinterpret_cast<unsigned char* const*>(device.data());
  auto* mapping = reinterpret_cast<const int64_t*>(device.data() + pointer_bytes);

  bool aligned = block_bytes % 16 == 0 && block_stride % 16 == 0;
  for (int64_t c = 0; c < num_caches; ++c) {
    aligned = aligned && reinterpret_cast<uintptr_t>(cache_bases[c]) % 16 == 0;
  }
  // Waves in order on one stream: a wave starts after the one before has finished.
  for (int w = 0; w < num_waves; ++w) {
    const int64_t first = wave_starts[w];
    const int64_t count = wave_starts[w + 1] - first;
    if (count == 0) continue;
    const dim3 grid(static_cast<unsigned>(count), static_cast<unsigned>(num_caches));
    const int64_t* wave = mapping + 2 * first;
    if (aligned) {
      copy_blocks_kernel<uint4>
          <<<grid, kThreads, 0, s>>>(bases, wave, block_stride, block_bytes / 16);
    } else {
      copy_blocks_kernel<unsigned char>
          <<<grid, kThreads, 0, s>>>(bases, wave, block_stride, block_bytes);
    }
    check_cuda("copy_blocks", cudaGetLastError(), "kernel launch");
  }
}

}  // namespace pyengine::cuda

namespace pyengine::cuda {

void swap_blocks(const void* src, int64_t src_stride, void* dst, int64_t dst_stride,
                 int64_t block_bytes, const int64_t* block_mapping, int64_t num_pairs,
                 int device_index, void* stream) {
  if (num_pairs == 0 || block_bytes == 0) return;
  const DeviceGuard device_guard(device_index);
  const auto s = static_cast<cudaStream_t>(stream);
  for (int64_t p = 0; p < num_pairs; ++p) {
    const auto* from = static_cast<const unsigned char*>(src) + block_mapping[2 * p] * src_stride;
    auto* to = static_cast<unsigned char*>(dst) + block_mapping[2 * p + 1] * dst_stride;
    check_cuda("swap_blocks",
               cudaMemcpyAsync(to, from, static_cast<size_t>(block_bytes), cudaMemcpyDefault, s),
               "cudaMemcpyAsync");
  }
}

}  // namespace pyengine::cuda
