// KV-cache groups: layers that share one kind of attention, and so one block table.
//
// A hybrid model (Gemma 2/3, gpt-oss, Llama 4) mixes attention kinds layer by layer. Its
// layers are split into groups of equal size, each of one kind; a request holds one
// block table per group, and every group's blocks come from the one BlockPool. A block
// of the pool is one page per layer slot (the group's i-th layer writes slot i), so the
// page size is common to all groups and any block can serve any group (see
// docs/architecture.md, "The hybrid KV cache").
//
// A group whose queries see only recent keys (a sliding window, or the current chunk of
// chunked local attention) needs no block that lies wholly before the first position
// its next query can see: the manager releases such blocks, so that the group's memory
// per request is bounded by the window, not the sequence.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>

namespace pyengine {

enum class KVGroupKind : uint8_t {
  kFull,     // every earlier position
  kSliding,  // a query at p sees (p - size, p]
  kChunked,  // a query at p sees [p - p % size, p]
};

struct KVGroupSpec {
  KVGroupKind kind = KVGroupKind::kFull;
  int size = 0;  // the window or the chunk, in tokens (> 0); 0 for a full group

  // The first position a query at `position` attends to.
  int64_t first_visible(int64_t position) const {
    switch (kind) {
      case KVGroupKind::kSliding:
        return std::max<int64_t>(0, position - size + 1);
      case KVGroupKind::kChunked:
        return position - position % size;
      case KVGroupKind::kFull:
        break;
    }
    return 0;
  }
  // The first block that queries at `position` and later can read.
  int64_t first_needed_block(int64_t position, int block_size) const {
    return first_visible(position) / block_size;
  }
  friend bool operator==(const KVGroupSpec&, const KVGroupSpec&) = default;
};

// The most groups a manager takes (a plan of an allocation keeps one entry per group
// on the stack).
inline constexpr int kMaxKVGroups = 32;

// The most blocks of all `groups` one request of `num_tokens` tokens holds at once,
// where no allocation schedules more than `max_step_tokens` tokens (drafts included): a
// full group all of its blocks, a window's those its step's queries may read. What the
// scheduler admits by, and the model runner sizes its smallest pool by.
int64_t max_blocks_held(std::span<const KVGroupSpec> groups, int block_size, int64_t num_tokens,
                        int64_t max_step_tokens);

// "full", "sliding" or "chunked" (as the Python bindings spell them).
KVGroupKind parse_kv_group_kind(const std::string& name);
const char* kv_group_kind_name(KVGroupKind kind);

}  // namespace pyengine
