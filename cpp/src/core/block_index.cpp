#include "pyengine/block_index.h"

#include "pyengine/errors.h"

namespace pyengine {

BlockIndex::BlockIndex(int max_entries) : max_entries_(max_entries) {
  check_argument(max_entries > 0, "BlockIndex: max_entries must be positive");
  size_t capacity = 16;
  while (capacity < 2 * static_cast<size_t>(max_entries)) capacity *= 2;
  slots_.resize(capacity);
  mask_ = capacity - 1;
}

size_t BlockIndex::probe(const BlockKey& key) const {
  size_t i = home(key);
  while (slots_[i].block != kNoBlock && !(slots_[i].key == key)) i = (i + 1) & mask_;
  return i;
}

std::optional<BlockId> BlockIndex::find(const BlockKey& key) const {
  const Slot& slot = slots_[probe(key)];
  if (slot.block == kNoBlock) return std::nullopt;
  return slot.block;
}

bool BlockIndex::insert(const BlockKey& key, BlockId block) {
  const size_t i = probe(key);
  if (slots_[i].block != kNoBlock) return false;
  if (size_ >= max_entries_) throw InvalidState("BlockIndex: more entries than blocks");
  slots_[i] = {key, block};
  ++size_;
  return true;
}

bool BlockIndex::erase(const BlockKey& key) {
  size_t hole = probe(key);
  if (slots_[hole].block == kNoBlock) return false;
  // Backward-shift deletion: move each later entry of the run into the hole unless its
  // home lies cyclically in (hole, j], where it must stay to remain reachable.
  for (size_t j = (hole + 1) & mask_; slots_[j].block != kNoBlock; j = (j + 1) & mask_) {
    const size_t h = home(slots_[j].key);
    const bool stays = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
    if (!stays) {
      slots_[hole] = slots_[j];
      hole = j;
    }
  }
  slots_[hole] = Slot{};
  --size_;
  return true;
}

}  // namespace pyengine
