// Prefix hashing for the paged KV cache.
//
// A full block of `block_size` tokens is identified by a 128-bit BlockKey, a chained
// hash of (parent key, the block's token ids, the request's extra keys). Two requests
// share a block only when their whole prefix up to and including that block is equal,
// and only when their extra keys (adapter id, cache salt) are equal.
//
// The hash function is xxHash64 (Yann Collet's published algorithm, implemented here
// from its specification). A block's content hash is one xxHash64 of its token ids; its
// 128-bit key is two xxHash64 lanes (different seeds) over the 32-byte record
// (parent key, content hash, extras digest). Hashing a long prompt runs in two levels:
// every block's content hash (in parallel with OpenMP for very long prompts), then the
// cheap sequential chain.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "pyengine/tensor_view.h"

namespace pyengine {

using TokenId = int32_t;

// xxHash64 of `length` bytes at `data` with `seed`.
uint64_t xxhash64(const void* data, size_t length, uint64_t seed);

struct BlockKey {
  uint64_t hi = 0;
  uint64_t lo = 0;
  friend bool operator==(const BlockKey&, const BlockKey&) = default;
};

// Keys that change what a block's KV means although its tokens are equal.
struct BlockExtras {
  int64_t adapter_id = 0;  // LoRA adapter (0: none)
  std::string cache_salt;  // isolates tenants: different salts never share blocks
  // The KV-cache group a block belongs to: a block of one group's layers never serves
  // another's. (Block keys derive it apart; hash_extras leaves it out.)
  int kv_group = 0;
  friend bool operator==(const BlockExtras&, const BlockExtras&) = default;
};

// 64-bit digest of the extra keys, folded into every chain step.
uint64_t hash_extras(const BlockExtras& extras);

// The parent key of a request's first block.
inline constexpr BlockKey kRootBlockKey{0x243F6A8885A308D3ull, 0x13198A2E03707344ull};

// The key of one block: chain(parent, content hash of `block_tokens`, extras digest).
BlockKey hash_block(const BlockKey& parent, std::span<const TokenId> block_tokens,
                    uint64_t extras_hash);

// Keys of the full blocks of `token_ids` (a trailing partial block gets none), written
// to `out`, which must hold token_ids.size() / block_size keys. `parent` is the key of
// the block before token_ids[0] (kRootBlockKey at the start of a request).
// Content hashes run in parallel when there are many blocks.
void hash_blocks(std::span<const TokenId> token_ids, int block_size, uint64_t extras_hash,
                 const BlockKey& parent, std::span<BlockKey> out);

// The two levels apart, for a long prompt whose token ids are already on a GPU.
// Level 1: the content hash of each full block of `tokens` (int32 [n], dense, on the CPU
// or a CUDA device where pyengine was built with CUDA, there on `stream`) into `out`
// (int64 [n / block_size], the same device), every block in parallel on a GPU,
// bit-identical to the CPU. Throws InvalidArgument naming the argument.
void block_content_hashes(const TensorView& tokens, int block_size, const TensorView& out,
                          void* stream = nullptr);
// Level 2: the keys of blocks whose content hashes are `contents`, chained from `parent`.
void chain_block_keys(std::span<const uint64_t> contents, uint64_t extras_hash,
                      const BlockKey& parent, std::span<BlockKey> out);

}  // namespace pyengine
