// The pieces of xxHash64 (Yann Collet's published algorithm): its primes, its round, its
// merge and its avalanche. The CPU hash (cpp/src/core/prefix_hash.cpp) and the GPU one
// (cuda/prefix_hash.cu) build on these same pieces, so that both compute the same bits.
// The header is public because cuda/ reaches into cpp/ only through cpp/include; the whole
// hash an embedder calls is pyengine::xxhash64 (pyengine/prefix_hash.h). Plain C++ that
// nvcc also compiles for the device.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define PYENGINE_HOST_DEVICE __host__ __device__
#else
#define PYENGINE_HOST_DEVICE
#endif

namespace pyengine::detail::xxh64 {

inline constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ull;
inline constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr uint64_t kPrime3 = 0x165667B19E3779F9ull;
inline constexpr uint64_t kPrime4 = 0x85EBCA77C2B2AE63ull;
inline constexpr uint64_t kPrime5 = 0x27D4EB2F165667C5ull;

PYENGINE_HOST_DEVICE inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

PYENGINE_HOST_DEVICE inline uint64_t round(uint64_t acc, uint64_t input) {
  acc += input * kPrime2;
  acc = rotl(acc, 31);
  return acc * kPrime1;
}

PYENGINE_HOST_DEVICE inline uint64_t merge_round(uint64_t acc, uint64_t value) {
  acc ^= round(0, value);
  return acc * kPrime1 + kPrime4;
}

PYENGINE_HOST_DEVICE inline uint64_t avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= kPrime2;
  h ^= h >> 29;
  h *= kPrime3;
  h ^= h >> 32;
  return h;
}

}  // namespace pyengine::detail::xxh64
