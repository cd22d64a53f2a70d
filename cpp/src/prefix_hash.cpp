#include "pyengine/prefix_hash.h"

#include <cstring>
#include <vector>

#include "pyengine/errors.h"

namespace pyengine {
namespace {

constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kPrime3 = 0x165667B19E3779F9ull;
constexpr uint64_t kPrime4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kPrime5 = 0x27D4EB2F165667C5ull;

// Seeds of the two lanes of a 128-bit key (digits of e, any distinct odd values do).
constexpr uint64_t kSeedHi = 0xB7E151628AED2A6Bull;
constexpr uint64_t kSeedLo = 0x7E5E2F0E5C1A3D51ull;

// Below this many blocks, starting OpenMP threads costs more than it saves.
constexpr size_t kMinBlocksForParallel = 256;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// Unaligned little-endian loads (every platform pyengine targets is little-endian).
inline uint64_t load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline uint32_t load32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline uint64_t round(uint64_t acc, uint64_t input) {
  acc += input * kPrime2;
  acc = rotl(acc, 31);
  return acc * kPrime1;
}

inline uint64_t merge_round(uint64_t acc, uint64_t value) {
  acc ^= round(0, value);
  return acc * kPrime1 + kPrime4;
}

inline uint64_t avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= kPrime2;
  h ^= h >> 29;
  h *= kPrime3;
  h ^= h >> 32;
  return h;
}

// Content hash of one block's tokens: two xxHash64 lanes.
inline BlockKey hash_content(std::span<const TokenId> tokens) {
  const size_t bytes = tokens.size_bytes();
  return {xxhash64(tokens.data(), bytes, kSeedHi), xxhash64(tokens.data(), bytes, kSeedLo)};
}

// One chain step over the 40-byte record (parent, content, extras).
inline BlockKey chain(const BlockKey& parent, const BlockKey& content, uint64_t extras_hash) {
  const uint64_t record[5] = {parent.hi, parent.lo, content.hi, content.lo, extras_hash};
  return {xxhash64(record, sizeof record, kSeedHi), xxhash64(record, sizeof record, kSeedLo)};
}

}  // namespace

uint64_t xxhash64(const void* data, size_t length, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  const unsigned char* const end = p + length;
  uint64_t h;
  if (length >= 32) {
    uint64_t v1 = seed + kPrime1 + kPrime2;
    uint64_t v2 = seed + kPrime2;
    uint64_t v3 = seed;
    uint64_t v4 = seed - kPrime1;
    const unsigned char* const last_stripe = end - 32;
    do {
      v1 = round(v1, load64(p));
      v2 = round(v2, load64(p + 8));
      v3 = round(v3, load64(p + 16));
      v4 = round(v4, load64(p + 24));
      p += 32;
    } while (p <= last_stripe);
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = merge_round(h, v1);
    h = merge_round(h, v2);
    h = merge_round(h, v3);
    h = merge_round(h, v4);
  } else {
    h = seed + kPrime5;
  }
  h += static_cast<uint64_t>(length);
  for (; p + 8 <= end; p += 8) {
    h ^= round(0, load64(p));
    h = rotl(h, 27) * kPrime1 + kPrime4;
  }
  if (p + 4 <= end) {
    h ^= static_cast<uint64_t>(load32(p)) * kPrime1;
    h = rotl(h, 23) * kPrime2 + kPrime3;
    p += 4;
  }
  for (; p < end; ++p) {
    h ^= static_cast<uint64_t>(*p) * kPrime5;
    h = rotl(h, 11) * kPrime1;
  }
  return avalanche(h);
}

uint64_t hash_extras(const BlockExtras& extras) {
  const uint64_t adapter = static_cast<uint64_t>(extras.adapter_id);
  const uint64_t salt = xxhash64(extras.cache_salt.data(), extras.cache_salt.size(), kSeedLo);
  const uint64_t record[3] = {adapter, salt, static_cast<uint64_t>(extras.cache_salt.size())};
  return xxhash64(record, sizeof record, kSeedHi);
}

BlockKey hash_block(const BlockKey& parent, std::span<const TokenId> block_tokens,
                    uint64_t extras_hash) {
  return chain(parent, hash_content(block_tokens), extras_hash);
}

void hash_blocks(std::span<const TokenId> token_ids, int block_size, uint64_t extras_hash,
                 const BlockKey& parent, std::span<BlockKey> out) {
  check_argument(block_size > 0, "hash_blocks: block_size must be positive");
  const size_t num_blocks = token_ids.size() / static_cast<size_t>(block_size);
  check_argument(out.size() == num_blocks,
                 "hash_blocks: out must hold one key per full block of token_ids");
  const auto block = [&](size_t i) {
    return token_ids.subspan(i * static_cast<size_t>(block_size), static_cast<size_t>(block_size));
  };
  // Level 1: content hashes, independent per block, into `out` in place.
  const auto n = static_cast<int64_t>(num_blocks);
#pragma omp parallel for schedule(static) if (num_blocks >= kMinBlocksForParallel)
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = hash_content(block(static_cast<size_t>(i)));
  // Level 2: the chain, sequential but only 40 bytes per block.
  BlockKey previous = parent;
  for (size_t i = 0; i < num_blocks; ++i) {
    out[i] = chain(previous, out[i], extras_hash);
    previous = out[i];
  }
}

}  // namespace pyengine
