// Content hashes of many full blocks at once on the GPU (see prefix_hash_launch.h): a
// thread per block runs xxHash64 over its block_size token ids, the same algorithm and
// byte order as cpp/src/core/prefix_hash.cpp, so the results are bit-identical.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/prefix_hash_launch.h"
#include "cuda/runtime_guards.h"
#include "pyengine/xxhash64.h"

namespace pyengine::cuda {
namespace {

using namespace detail::xxh64;  // xxHash64's primes and rounds, shared with the other hash

constexpr int kThreads = 128;

// xxHash64 of `count` 32-bit words (a block's token ids, little-endian bytes).
__device__ uint64_t xxhash64_words(const uint32_t* words, int64_t count, uint64_t seed) {
  const int64_t length = count * 4;
  int64_t i = 0;  // words consumed
  uint64_t h;
  const auto word64 = [&](int64_t at) {
    return static_cast<uint64_t>(words[at]) | (static_cast<uint64_t>(words[at + 1]) << 32);
  };
  if (length >= 32) {
    uint64_t v1 = seed + kPrime1 + kPrime2, v2 = seed + kPrime2, v3 = seed, v4 = seed - kPrime1;
    for (; (i + 8) * 4 <= length; i += 8) {
      v1 = round(v1, word64(i));
      v2 = round(v2, word64(i + 2));
      v3 = round(v3, word64(i + 4));
      v4 = round(v4, word64(i + 6));
    }
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = merge_round(h, v1);
    h = merge_round(h, v2);
    h = merge_round(h, v3);
    h = merge_round(h, v4);
  } else {
    h = seed + kPrime5;
  }
  h += static_cast<uint64_t>(length);
  for (; i + 2 <= count; i += 2) h = rotl(h ^ round(0, word64(i)), 27) * kPrime1 + kPrime4;
  if (i < count) h = rotl(h ^ (static_cast<uint64_t>(words[i]) * kPrime1), 23) * kPrime2 + kPrime3;
  return avalanche(h);
}

__global__ void content_hash_kernel(const uint32_t* __restrict__ tokens, int64_t num_blocks,
                                    int block_size, uint64_t seed, uint64_t* __restrict__ out) {
  const int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (b < num_blocks) out[b] = xxhash64_words(tokens + b * block_size, block_size, seed);
}

}  // namespace

void block_content_hashes(const int32_t* tokens, int64_t num_blocks, int block_size, uint64_t seed,
                          uint64_t* out, int device_index, void* stream) {
  if (num_blocks == 0) return;
  const DeviceGuard guard(device_index);
  const auto blocks = static_cast<unsigned>((num_blocks + kThreads - 1) / kThreads);
  content_hash_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const uint32_t*>(tokens), num_blocks, block_size, seed, out);
  check_cuda("block_content_hashes", cudaGetLastError(), "kernel launch");
}

}  // namespace pyengine::cuda
