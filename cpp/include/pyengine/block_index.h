// BlockIndex: the prefix-cache index, BlockKey -> BlockId.
//
// Open addressing with linear probing over a fixed power-of-two table at least twice
// the pool's size: the index never holds more entries than there are blocks, so it
// never rehashes and never allocates after construction (a node-based map allocates on
// every insert, and caching and eviction happen on every step). Keys are already
// well-mixed hashes, so their low bits pick the home slot. Erase shifts later entries
// back instead of leaving tombstones, so lookups stay short however long it runs.
#pragma once

#include <optional>
#include <vector>

#include "pyengine/prefix_hash.h"

namespace pyengine {

using BlockId = int32_t;

inline constexpr BlockId kNoBlock = -1;

class BlockIndex {
 public:
  explicit BlockIndex(int max_entries);

  int size() const { return size_; }
  std::optional<BlockId> find(const BlockKey& key) const;
  // Returns false, changing nothing, if `key` is present. Throws InvalidState when full.
  bool insert(const BlockKey& key, BlockId block);
  // Returns whether `key` was present.
  bool erase(const BlockKey& key);

 private:
  struct Slot {
    BlockKey key;
    BlockId block = kNoBlock;  // kNoBlock: empty
  };

  size_t home(const BlockKey& key) const { return static_cast<size_t>(key.lo) & mask_; }
  // The slot holding `key`, or the empty slot where its probe ends.
  size_t probe(const BlockKey& key) const;

  std::vector<Slot> slots_;
  size_t mask_;
  int size_ = 0;
  int max_entries_;
};

}  // namespace pyengine
