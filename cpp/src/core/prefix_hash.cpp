#include "pyengine/prefix_hash.h"

#include <array>
#include <cstring>
#include <vector>

#include "pyengine/errors.h"
#include "pyengine/xxhash64.h"
#ifdef PYENGINE_WITH_CUDA
#include "cuda/prefix_hash_launch.h"
#endif

namespace pyengine {
namespace {

using namespace detail::xxh64;  // xxHash64's primes and rounds, shared with the other hash

// Seeds of the two lanes of a 128-bit key (digits of e, any distinct odd values do).
constexpr uint64_t kSeedHi = 0xB7E151628AED2A6Bull;
constexpr uint64_t kSeedLo = 0x7E5E2F0E5C1A3D51ull;

// Below this many blocks (128k tokens) hashing stays on the calling thread: more threads
// gain little (the chain is serial), while a fork-join whose worker waits for a core that
// the model's own threads keep busy stalls far longer, so only very long prompts are
// worth the risk.
constexpr size_t kMinBlocksForParallel = 8192;

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

// xxHash64 of one input under N seeds at once. The lanes share every load and their
// independent multiply chains interleave, so two lanes cost little more than one.
template <size_t N>
inline std::array<uint64_t, N> xxhash64_lanes(const void* data, size_t length,
                                              const std::array<uint64_t, N>& seeds) {
  const auto* p = static_cast<const unsigned char*>(data);
  const unsigned char* const end = p + length;
  std::array<uint64_t, N> h;
  if (length >= 32) {
    std::array<std::array<uint64_t, 4>, N> v;
    for (size_t l = 0; l < N; ++l) {
      v[l] = {seeds[l] + kPrime1 + kPrime2, seeds[l] + kPrime2, seeds[l], seeds[l] - kPrime1};
    }
    const unsigned char* const last_stripe = end - 32;
    do {
      const uint64_t in[4] = {load64(p), load64(p + 8), load64(p + 16), load64(p + 24)};
      for (size_t l = 0; l < N; ++l) {
        for (size_t k = 0; k < 4; ++k) v[l][k] = round(v[l][k], in[k]);
      }
      p += 32;
    } while (p <= last_stripe);
    for (size_t l = 0; l < N; ++l) {
      h[l] = rotl(v[l][0], 1) + rotl(v[l][1], 7) + rotl(v[l][2], 12) + rotl(v[l][3], 18);
      for (size_t k = 0; k < 4; ++k) h[l] = merge_round(h[l], v[l][k]);
    }
  } else {
    for (size_t l = 0; l < N; ++l) h[l] = seeds[l] + kPrime5;
  }
  for (size_t l = 0; l < N; ++l) h[l] += static_cast<uint64_t>(length);
  for (; p + 8 <= end; p += 8) {
    const uint64_t k1 = round(0, load64(p));
    for (size_t l = 0; l < N; ++l) h[l] = rotl(h[l] ^ k1, 27) * kPrime1 + kPrime4;
  }
  if (p + 4 <= end) {
    const uint64_t k1 = static_cast<uint64_t>(load32(p)) * kPrime1;
    for (size_t l = 0; l < N; ++l) h[l] = rotl(h[l] ^ k1, 23) * kPrime2 + kPrime3;
    p += 4;
  }
  for (; p < end; ++p) {
    const uint64_t k1 = static_cast<uint64_t>(*p) * kPrime5;
    for (size_t l = 0; l < N; ++l) h[l] = rotl(h[l] ^ k1, 11) * kPrime1;
  }
  for (size_t l = 0; l < N; ++l) h[l] = avalanche(h[l]);
  return h;
}

// A 128-bit key: the two lanes of xxhash64_lanes.
inline BlockKey hash128(const void* data, size_t length) {
  const auto h = xxhash64_lanes<2>(data, length, {kSeedHi, kSeedLo});
  return {h[0], h[1]};
}

// Content hash of one block's tokens. 64 bits suffice here: two blocks whose contents
// collide get one key, and verification (stored tokens) turns that into a cache miss.
inline uint64_t hash_content(std::span<const TokenId> tokens) {
  return xxhash64_lanes<1>(tokens.data(), tokens.size_bytes(), {kSeedHi})[0];
}

// One chain step over the 32-byte record (parent key, content hash, extras digest).
inline BlockKey chain(const BlockKey& parent, uint64_t content, uint64_t extras_hash) {
  const uint64_t record[4] = {parent.hi, parent.lo, content, extras_hash};
  return hash128(record, sizeof record);
}

// Level 2 of hash_blocks: out[i] = chain(out[i - 1] or parent, content(i), extras),
// sequential but only 32 bytes per block.
template <class Content>
void chain_keys(const BlockKey& parent, uint64_t extras_hash, std::span<BlockKey> out,
                Content&& content) {
  BlockKey previous = parent;
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = chain(previous, content(i), extras_hash);
    previous = out[i];
  }
}

}  // namespace

uint64_t xxhash64(const void* data, size_t length, uint64_t seed) {
  return xxhash64_lanes<1>(data, length, {seed})[0];
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
  // Level 1: content hashes, independent per block, parked in `out[i].lo`. The branch
  // keeps short prompts out of the OpenMP runtime, which sets up a team even when an
  // `if` clause turns the region serial.
  const auto content = [&](int64_t i) {
    out[static_cast<size_t>(i)].lo = hash_content(block(static_cast<size_t>(i)));
  };
  const auto n = static_cast<int64_t>(num_blocks);
  if (num_blocks >= kMinBlocksForParallel) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) content(i);
  } else {
    for (int64_t i = 0; i < n; ++i) content(i);
  }
  chain_keys(parent, extras_hash, out, [&](size_t i) { return out[i].lo; });
}

void chain_block_keys(std::span<const uint64_t> contents, uint64_t extras_hash,
                      const BlockKey& parent, std::span<BlockKey> out) {
  check_argument(out.size() == contents.size(),
                 "chain_block_keys: out must hold one key per content hash");
  chain_keys(parent, extras_hash, out, [&](size_t i) { return contents[i]; });
}

void block_content_hashes(const TensorView& tokens, int block_size, const TensorView& out,
                          void* stream) {
  constexpr const char* op = "block_content_hashes";
  check_argument(block_size > 0, "block_content_hashes: block_size must be positive");
  if (tokens.dtype != DType::kInt32 || tokens.ndim != 1 || !tokens.is_contiguous()) {
    throw InvalidArgument(std::string(op) + ": tokens must be dense int32 [n], got " +
                          tokens.describe());
  }
  const int64_t num_blocks = tokens.shape[0] / block_size;
  if (out.dtype != DType::kInt64 || out.ndim != 1 || !out.is_contiguous() ||
      out.shape[0] != num_blocks || out.device != tokens.device) {
    throw InvalidArgument(std::string(op) + ": out must be dense int64 [" +
                          std::to_string(num_blocks) + "] on " + device_name(tokens.device) +
                          ", got " + out.describe());
  }
  auto* hashes = static_cast<uint64_t*>(out.data);  // int64 storage, the same bits
  const auto* ids = static_cast<const TokenId*>(tokens.data);
  if (tokens.device.kind == DeviceKind::kCUDA) {
#ifdef PYENGINE_WITH_CUDA
    cuda::block_content_hashes(ids, num_blocks, block_size, kSeedHi, hashes, tokens.device.index,
                               stream);
    return;
#else
    throw InvalidArgument(std::string(op) + ": tokens are on " + device_name(tokens.device) +
                          " but pyengine was built without CUDA (PYENGINE_CUDA=off or no nvcc)");
#endif
  }
  (void)stream;
  for (int64_t b = 0; b < num_blocks; ++b) {
    hashes[b] = hash_content({ids + b * block_size, static_cast<size_t>(block_size)});
  }
}

}  // namespace pyengine
