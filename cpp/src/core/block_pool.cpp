#include "pyengine/block_pool.h"

#include <algorithm>
#include <atomic>
#include <string>

#include "pyengine/errors.h"

namespace pyengine {

namespace {

// Entries are numbered for the whole process: a copy in another pool keeps its number,
// and no two contents ever share one.
uint64_t new_entry() {
  static std::atomic<uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}

int checked_num_blocks(int num_blocks) {
  check_argument(num_blocks > 0, "num_blocks must be positive");
  return num_blocks;
}

}  // namespace

BlockPool::BlockPool(int num_blocks, int block_size)
    : block_size_(block_size), index_(checked_num_blocks(num_blocks)) {
  check_argument(block_size > 0 && (block_size & (block_size - 1)) == 0,
                 "block_size must be a positive power of two");
  blocks_.resize(static_cast<size_t>(num_blocks));
  first_block_extras_.resize(static_cast<size_t>(num_blocks));
  stored_tokens_.resize(static_cast<size_t>(num_blocks) * static_cast<size_t>(block_size));
  for (BlockId b = 0; b < num_blocks; ++b) push_back(FreeList::kUncached, b);
}

void BlockPool::throw_out_of_range(BlockId block) const {
  throw InvalidArgument("block id " + std::to_string(block) + " is out of range [0, " +
                        std::to_string(num_blocks()) + ")");
}

void BlockPool::push_back(FreeList which, BlockId block) {
  List& list = list_of(which);
  Meta& m = blocks_[static_cast<size_t>(block)];
  m.list = which;
  m.prev = list.tail;
  m.next = kNoBlock;
  if (list.tail != kNoBlock) {
    blocks_[static_cast<size_t>(list.tail)].next = block;
  } else {
    list.head = block;
  }
  list.tail = block;
  ++list.size;
}

void BlockPool::push_front(FreeList which, BlockId block) {
  List& list = list_of(which);
  Meta& m = blocks_[static_cast<size_t>(block)];
  m.list = which;
  m.prev = kNoBlock;
  m.next = list.head;
  if (list.head != kNoBlock) {
    blocks_[static_cast<size_t>(list.head)].prev = block;
  } else {
    list.tail = block;
  }
  list.head = block;
  ++list.size;
}

void BlockPool::unlink(BlockId block) {
  Meta& m = blocks_[static_cast<size_t>(block)];
  List& list = list_of(m.list);
  if (m.prev != kNoBlock) {
    blocks_[static_cast<size_t>(m.prev)].next = m.next;
  } else {
    list.head = m.next;
  }
  if (m.next != kNoBlock) {
    blocks_[static_cast<size_t>(m.next)].prev = m.prev;
  } else {
    list.tail = m.prev;
  }
  m.prev = m.next = kNoBlock;
  m.list = FreeList::kNone;
  --list.size;
}

BlockId BlockPool::pop_front(FreeList which) {
  const BlockId block = list_of(which).head;
  unlink(block);
  return block;
}

void BlockPool::drop_cache_entry(BlockId block) {
  Meta& m = blocks_[static_cast<size_t>(block)];
  index_.erase(m.key);
  if (m.parent.entry == 0) first_block_extras_[static_cast<size_t>(block)] = {};
  m.is_cached = false;
  m.key = {};
  m.parent = {};
  m.entry = 0;  // children verify against this entry only where another tier holds it
}

BlockId BlockPool::allocate() {
  if (num_free_blocks() == 0) throw InvalidState("BlockPool::allocate: no free block");
  BlockId block;
  if (uncached_free_.size > 0) {
    block = pop_front(FreeList::kUncached);
  } else {
    block = pop_front(FreeList::kCached);
    drop_cache_entry(block);
    ++num_evictions_;
  }
  Meta& m = blocks_[static_cast<size_t>(block)];
  m.ref_count = 1;
  m.num_filled = 0;
  ++num_in_use_;
  return block;
}

void BlockPool::retain(BlockId block) {
  meta(block);  // range check
  Meta& m = blocks_[static_cast<size_t>(block)];
  if (m.ref_count == 0) {
    if (m.list == FreeList::kNone) throw InvalidState("retain: free block in no free list");
    unlink(block);
    ++num_in_use_;
    num_filled_in_use_ += m.num_filled;
  }
  ++m.ref_count;
}

void BlockPool::release(BlockId block) {
  meta(block);
  Meta& m = blocks_[static_cast<size_t>(block)];
  if (m.ref_count <= 0) {
    throw InvalidState("release: block " + std::to_string(block) + " is already free");
  }
  if (--m.ref_count > 0) return;
  --num_in_use_;
  num_filled_in_use_ -= m.num_filled;
  if (m.is_cached) {
    push_back(FreeList::kCached, block);
  } else {
    push_front(FreeList::kUncached, block);
  }
}

std::optional<BlockId> BlockPool::next_eviction() const {
  if (uncached_free_.size > 0 || cached_free_.size == 0) return std::nullopt;
  return cached_free_.head;
}

std::optional<BlockId> BlockPool::lookup(const BlockKey& key) const { return index_.find(key); }

std::span<const TokenId> BlockPool::stored_tokens(BlockId block) const {
  meta(block);
  return {stored_tokens_.data() + static_cast<size_t>(block) * static_cast<size_t>(block_size_),
          static_cast<size_t>(block_size_)};
}

bool BlockPool::verify(BlockId block, std::span<const TokenId> tokens, const BlockLink& parent,
                       const BlockExtras& extras) const {
  const Meta& m = meta(block);
  if (!m.is_cached || !(m.parent == parent)) return false;
  if (tokens.size() != static_cast<size_t>(block_size_)) return false;
  const auto stored = stored_tokens(block);
  if (!std::equal(stored.begin(), stored.end(), tokens.begin())) return false;
  if (parent.entry != 0) return true;
  return first_block_extras_[static_cast<size_t>(block)] == extras;
}

bool BlockPool::cache(BlockId block, const BlockKey& key, std::span<const TokenId> tokens,
                      const BlockLink& parent, const BlockExtras& extras, BlockLink entry) {
  const Meta& m = meta(block);
  check_argument(tokens.size() == static_cast<size_t>(block_size_),
                 "cache: a cached block must be full (block_size tokens)");
  if (m.ref_count == 0) throw InvalidState("cache: block " + std::to_string(block) + " is free");
  if (m.is_cached) {
    if (m.key == key) return true;
    throw InvalidState("cache: block " + std::to_string(block) + " already has another key");
  }
  if (!index_.insert(key, block)) return false;
  Meta& w = blocks_[static_cast<size_t>(block)];
  w.is_cached = true;
  w.key = key;
  w.parent = parent;
  w.entry = entry.entry != 0 ? entry.entry : new_entry();
  std::copy(tokens.begin(), tokens.end(),
            stored_tokens_.begin() + static_cast<ptrdiff_t>(block) * block_size_);
  if (parent.entry == 0) first_block_extras_[static_cast<size_t>(block)] = extras;
  return true;
}

void BlockPool::uncache(BlockId block) {
  const Meta& m = meta(block);
  if (!m.is_cached || m.ref_count == 0) {
    throw InvalidState("uncache: block " + std::to_string(block) + " is not cached and in use");
  }
  drop_cache_entry(block);
}

bool BlockPool::reset_prefix_cache() {
  if (num_in_use_ > 0) return false;
  while (cached_free_.size > 0) {  // from the tail: the head of the list ends first
    const BlockId block = cached_free_.tail;
    unlink(block);
    drop_cache_entry(block);
    push_front(FreeList::kUncached, block);
  }
  return true;
}

void BlockPool::set_num_filled(BlockId block, int num_filled) {
  meta(block);
  check_argument(num_filled >= 0 && num_filled <= block_size_,
                 "set_num_filled: num_filled must be in [0, block_size]");
  Meta& m = blocks_[static_cast<size_t>(block)];
  if (m.ref_count > 0) num_filled_in_use_ += num_filled - m.num_filled;
  m.num_filled = num_filled;
}

std::vector<BlockId> BlockPool::free_blocks_in_order() const {
  std::vector<BlockId> order;
  order.reserve(static_cast<size_t>(num_free_blocks()));
  for (const List* list : {&uncached_free_, &cached_free_}) {
    for (BlockId b = list->head; b != kNoBlock; b = blocks_[static_cast<size_t>(b)].next) {
      order.push_back(b);
    }
  }
  return order;
}

}  // namespace pyengine
