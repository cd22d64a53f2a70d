// BlockPool: the physical KV-cache blocks, their reference counts, the free queue and
// the prefix-cache index.
//
// Every block is in exactly one of three places:
//   - in use: ref_count > 0, held by one or more block tables;
//   - the uncached free list: ref_count == 0, holds no reusable KV;
//   - the cached free list: ref_count == 0, still indexed by its BlockKey so that a
//     later request with the same prefix can reuse it.
// Allocation takes uncached blocks first, most recently freed first (their memory is
// committed and likely still in cache; a fresh pool hands out blocks in id order), then
// evicts cached free blocks least recently freed first. Both free lists are intrusive
// doubly linked lists over block ids, because a prefix hit must take a block out of the
// middle of the cached list in O(1); no operation here scans the pool.
//
// A cached block records how to verify a hit without trusting the hash: its token
// ids, its parent's entry and, for a first block, the request's extra keys. A hit is
// accepted only when all of these equal the request's. An entry is one cached
// incarnation of a block's content, numbered once in the process: it ends when the
// block is evicted or its cache entry dropped, and it keeps its number when another
// tier (a host pool, itself a BlockPool) takes a copy of it, so that links between
// parents and children verify across tiers.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "pyengine/block_index.h"
#include "pyengine/prefix_hash.h"

namespace pyengine {

// Identifies one cache entry: a parent link stays valid only while some block, in any
// tier, still holds the parent's entry.
struct BlockLink {
  uint64_t entry = 0;  // 0: none (the block is a request's first block)
  friend bool operator==(const BlockLink&, const BlockLink&) = default;
};

class BlockPool {
 public:
  // Throws InvalidArgument unless num_blocks > 0 and block_size is a power of two.
  BlockPool(int num_blocks, int block_size);

  int num_blocks() const { return static_cast<int>(blocks_.size()); }
  int block_size() const { return block_size_; }
  // Blocks with ref_count == 0 (cached or not): what allocate() can hand out.
  int num_free_blocks() const { return uncached_free_.size + cached_free_.size; }
  int num_cached_blocks() const { return index_.size(); }
  int64_t num_evictions() const { return num_evictions_; }
  // Token slots of in-use blocks that hold a token's KV.
  int64_t num_filled_slots_in_use() const { return num_filled_in_use_; }

  bool can_allocate(int n) const { return n >= 0 && n <= num_free_blocks(); }
  // Takes one free block (ref_count becomes 1), evicting a cached one if no uncached
  // block is free. Throws InvalidState when none is free: call can_allocate first.
  BlockId allocate();
  // Adds a holder to a block; a cached free block leaves the free list (a prefix hit).
  void retain(BlockId block);
  // Drops a holder; at zero the block joins its free list: the head of the uncached one
  // (taken next), the tail of the cached one (evicted last).
  void release(BlockId block);
  // The cached block the next allocate() evicts, if it evicts one.
  std::optional<BlockId> next_eviction() const;

  // The cached block indexed under `key`, if any. Does not verify it.
  std::optional<BlockId> lookup(const BlockKey& key) const;
  // Whether cached `block` holds exactly `tokens` after `parent` with `extras` (extras
  // are compared for first blocks only; later blocks inherit them through the parent).
  bool verify(BlockId block, std::span<const TokenId> tokens, const BlockLink& parent,
              const BlockExtras& extras) const;
  // Indexes in-use `block` under `key`, as a new entry, or as `entry` where the block
  // holds a copy of that entry from another tier. Returns false, changing nothing, when
  // another block already holds `key`. A block's key is written once: caching a block
  // that is already cached is an InvalidState unless it is the same key (then a no-op).
  bool cache(BlockId block, const BlockKey& key, std::span<const TokenId> tokens,
             const BlockLink& parent, const BlockExtras& extras, BlockLink entry = {});
  // Drops the cache entry of in-use `block` (its KV will not be computed after all).
  // Throws InvalidState unless it is cached and in use.
  void uncache(BlockId block);
  // Drops every cache entry (the dropped blocks are taken next, in the order they would
  // have been evicted). Returns false, changing nothing, while any block is in use.
  bool reset_prefix_cache();

  // How many tokens' KV `block` holds (for the internal-waste statistic).
  void set_num_filled(BlockId block, int num_filled);

  // Introspection (tests, statistics); each throws InvalidArgument on a bad id.
  int ref_count(BlockId block) const { return meta(block).ref_count; }
  int num_filled(BlockId block) const { return meta(block).num_filled; }
  bool is_cached(BlockId block) const { return meta(block).is_cached; }
  bool is_free(BlockId block) const { return meta(block).list != FreeList::kNone; }
  BlockKey key(BlockId block) const { return meta(block).key; }
  // A cached block's entry ({} when it is not cached), its parent's, and the extras
  // of a first block.
  BlockLink link(BlockId block) const { return {meta(block).entry}; }
  BlockLink parent(BlockId block) const { return meta(block).parent; }
  const BlockExtras& first_block_extras(BlockId block) const {
    meta(block);
    return first_block_extras_[static_cast<size_t>(block)];
  }
  std::span<const TokenId> stored_tokens(BlockId block) const;
  // Free blocks in allocation order: uncached most recently freed first, then cached
  // least recently freed first.
  std::vector<BlockId> free_blocks_in_order() const;

 private:
  enum class FreeList : uint8_t { kNone, kUncached, kCached };

  struct Meta {
    int32_t ref_count = 0;
    int32_t num_filled = 0;
    uint64_t entry = 0;  // while cached
    bool is_cached = false;
    FreeList list = FreeList::kNone;
    BlockId prev = kNoBlock;  // free-list neighbours
    BlockId next = kNoBlock;
    BlockKey key;
    BlockLink parent;
  };

  struct List {
    BlockId head = kNoBlock;
    BlockId tail = kNoBlock;
    int size = 0;
  };

  const Meta& meta(BlockId block) const {
    if (block < 0 || block >= num_blocks()) throw_out_of_range(block);
    return blocks_[static_cast<size_t>(block)];
  }
  [[noreturn]] void throw_out_of_range(BlockId block) const;
  List& list_of(FreeList which) {
    return which == FreeList::kCached ? cached_free_ : uncached_free_;
  }
  void push_back(FreeList which, BlockId block);
  void push_front(FreeList which, BlockId block);
  void unlink(BlockId block);
  BlockId pop_front(FreeList which);
  void drop_cache_entry(BlockId block);

  int block_size_;
  std::vector<Meta> blocks_;
  std::vector<TokenId> stored_tokens_;           // [num_blocks, block_size], valid while cached
  std::vector<BlockExtras> first_block_extras_;  // [num_blocks], set for cached first blocks
  BlockIndex index_;
  List uncached_free_;
  List cached_free_;
  int num_in_use_ = 0;
  int64_t num_filled_in_use_ = 0;
  int64_t num_evictions_ = 0;
};

}  // namespace pyengine
