// KVCacheManager: per-request block tables over a BlockPool, with prefix caching and
// copy-on-write.
//
// The life of a request:
//   add_request(id, prompt)            tokens known, keys of its full blocks computed
//   get_computed_blocks(id)            longest verified cached prefix (changes nothing)
//   allocate_slots(id, n, k, &hit)     first step: takes the hit, n tokens + k lookahead
//   append_token_ids(id, sampled)      each step: new tokens become known
//   allocate_slots(id, n, k)           each later step
//   free(id)                           blocks released (tail first), request forgotten
// A block is cached once all its tokens are known and their KV is scheduled, i.e.
// when allocate_slots moves num_computed_tokens past its end. A request's cached blocks
// always form a prefix of its block table, so every cached block's parent is cached.
//
// Copy-on-write: fork() shares every block of a request with a new one. Before
// allocate_slots lets a request write into a block that another table also holds, it
// copies the block; the (src, dst) pairs wait in take_pending_copies() for the model
// runner, which must run them (copy_blocks) before that step's forward pass.
//
// A host tier (num_host_blocks > 0): a second BlockPool whose blocks live in host
// memory (or a file). A cached block that allocation evicts from the device pool is
// copied there first, under the same entry, so a later request finds it: its prefix
// hit continues in the host tier after the device's ends, and each such block is
// copied back into a new device block. Preemption may swap a request out instead of
// freeing it (swap_out): all its blocks are copied to host blocks it holds, and its
// next allocate_slots copies them back. The copies wait in take_pending_transfers()
// and must run before the step's forward pass, and before its copy-on-write pairs:
// every device-to-host copy, then every host-to-device copy. (A block copied in by a
// step is held by a request all through it, so no later copy of that step reads it.)
//
// KV-cache groups (kv_group.h): a hybrid model's requests hold one block table per
// group, all over the one pool. A table is indexed by logical block (position /
// block_size); a sliding or chunked group's entries before the first block its next
// query can see are released at the start of an allocation (kNoBlock in the table), so
// its blocks per request stay bounded by the window. Each group caches its own blocks
// under its own keys; a prefix hit is the longest prefix every group's chain verifies
// (device, then host tier), and a group takes only the hit blocks it still needs.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "pyengine/block_pool.h"
#include "pyengine/kv_group.h"
#include "pyengine/prefix_hash.h"

namespace pyengine {

using RequestId = std::string;

// A request's place in a KVCacheManager, for callers on a hot path (the scheduler) that
// would otherwise look the id up on every call. Valid until the request is freed; a
// stale handle is an InvalidArgument, never another request.
struct RequestHandle {
  uint32_t slot = UINT32_MAX;
  uint32_t generation = 0;
};

// The caller sets every field (the engine's defaults live in Python's EngineArgs); the
// zeros only keep a forgotten one from being indeterminate, and 0 sizes are rejected.
struct KVCacheConfig {
  int num_blocks = 0;
  int block_size = 0;  // tokens per block, a power of two
  bool enable_prefix_caching = false;
  int num_host_blocks = 0;  // > 0: a host tier of that many blocks
  std::vector<KVGroupSpec> groups;  // empty: one full-attention group
  // > 0: each request holds one of this many recurrent-state slots (a hybrid model's
  // Gated DeltaNet or Mamba layers index their state tensors by it), taken at its first
  // allocation and released when it is freed (a request swapped out keeps it, its state
  // in place). With prefix caching it needs num_state_checkpoints.
  int num_state_slots = 0;
  // > 0 (with state slots and prefix caching; one KV-cache group, no host tier): a hit
  // resumes a recurrent state from a checkpoint, a copy of a request's state at the end
  // of a cached block, kept in slots num_state_slots .. + num_state_checkpoints - 1
  // (reused oldest first) for as long as that block keeps its cache entry. A request's
  // state is checkpointed where an allocation ends at a block boundary (the scheduler
  // ends prefill chunks there); a hit ends at the last block that has one.
  int num_state_checkpoints = 0;
  // Checkpoints at every this many blocks (>= 1) of a request, and at its prompt's last
  // full block (where a later prompt that shares it resumes): a larger interval keeps
  // each checkpoint that many times longer in the same slots, and a hit may end up to
  // interval - 1 blocks earlier.
  int state_checkpoint_interval = 1;
  // Speculative decoding with state slots: each request slot s has a snapshot slot
  // (num_state_slots + num_state_checkpoints + s) where a verifying step's state is saved
  // before it runs, and from which it is put back where a draft was rejected (the state
  // took the draft in, and cannot give it back).
  bool state_snapshots = false;
};

// One group's part of a prefix hit: the hit blocks it still needs, from logical block
// first_block on, device blocks then host-tier blocks.
struct GroupHit {
  int first_block = 0;  // earlier blocks lie outside the group's window
  std::vector<BlockId> block_ids;
  std::vector<BlockId> host_block_ids;  // the host tier's, after block_ids
  BlockLink parent;                     // the entry of the chain's block first_block - 1
};

// The verified cached prefix of a request, every group's part of it.
struct ComputedBlocks {
  std::vector<GroupHit> groups;  // one per group (empty: no lookup was made)
  int num_computed_tokens = 0;   // a multiple of block_size
  int num_host_tokens = 0;       // of those, tokens past some group's device prefix
  int state_checkpoint = -1;     // the state slot the hit's recurrent state resumes from
};

// Block copies between the tiers, (source, destination) each, in the order to run.
struct KVTransfers {
  std::vector<std::pair<BlockId, BlockId>> to_host;    // device block -> host block
  std::vector<std::pair<BlockId, BlockId>> to_device;  // host block -> device block
};

struct KVCacheStats {
  int num_blocks = 0;
  int num_used_blocks = 0;  // held by at least one block table
  int num_free_blocks = 0;  // allocatable, cached or not
  int num_cached_blocks = 0;
  double usage = 0.0;                 // num_used_blocks / num_blocks
  int64_t prefix_cache_queries = 0;   // prompt tokens looked up
  int64_t prefix_cache_hits = 0;      // of those, tokens found cached
  int64_t num_evictions = 0;          // cached blocks reused for other content
  int64_t internal_waste_tokens = 0;  // slots of used blocks holding no token's KV
  // The host tier (zeros without one).
  int num_host_blocks = 0;
  int num_host_used_blocks = 0;  // held by swapped-out requests or a pending copy
  int num_host_cached_blocks = 0;
  int64_t host_cache_hits = 0;           // of prefix_cache_hits, tokens the host tier held
  int64_t num_blocks_offloaded = 0;      // evicted device blocks copied to the host tier
  int64_t num_blocks_swapped_out = 0;    // preempted requests' blocks copied out
  int num_swapped_requests = 0;          // requests swapped out now
};

class KVCacheManager {
 public:
  // Throws InvalidArgument on a non-positive num_blocks or a block_size that is not a
  // power of two.
  explicit KVCacheManager(const KVCacheConfig& config);

  const KVCacheConfig& config() const { return config_; }
  int block_size() const { return config_.block_size; }
  int num_groups() const { return static_cast<int>(config_.groups.size()); }
  // The most blocks of all groups a request of `num_tokens` tokens holds at once, where
  // no allocation schedules more than `max_step_tokens` tokens (drafts included; see
  // kv_group.h).
  int64_t max_blocks_held(int64_t num_tokens, int64_t max_step_tokens) const;
  int num_free_blocks() const { return pool_.num_free_blocks(); }
  bool has_request(const RequestId& id) const { return request_slots_.count(id) > 0; }
  int num_requests() const { return static_cast<int>(request_slots_.size()); }

  // Registers a request with its prompt. Throws InvalidArgument on a duplicate id, an
  // empty prompt or a negative token id.
  void add_request(const RequestId& id, std::span<const TokenId> prompt_token_ids,
                   BlockExtras extras = {});
  // Appends tokens (sampled or otherwise known) to a request. Throws UnknownRequest,
  // InvalidArgument on a negative token id.
  void append_token_ids(const RequestId& id, std::span<const TokenId> token_ids);
  void append_token_ids(RequestHandle handle, std::span<const TokenId> token_ids);

  // The longest verified cached prefix of a request that has no blocks yet; never all
  // its tokens (at least one must be computed to produce logits). The first lookup of a
  // request counts in the prefix-cache statistics (a request that waits and looks up
  // again is not counted twice); nothing else changes.
  ComputedBlocks get_computed_blocks(const RequestId& id);

  // The handle of a request. Throws UnknownRequest.
  RequestHandle handle(const RequestId& id) const;

  // Whether allocate_slots with the same arguments would succeed.
  bool can_allocate_slots(const RequestId& id, int num_new_tokens, int num_lookahead = 0,
                          const ComputedBlocks* computed = nullptr) const;
  // Schedules KV for the next `num_new_tokens` known tokens, plus `num_lookahead` slots
  // for draft tokens, taking `computed` (from get_computed_blocks, first allocation only)
  // first. Returns the newly allocated block ids (a view of the end of the request's
  // block table, valid until the request next changes), or nullopt, changing nothing,
  // when the pool has too few free blocks. Throws UnknownRequest, InvalidArgument on
  // num_new_tokens <= 0, num_lookahead < 0, tokens not yet known, or stale `computed`.
  std::optional<std::span<const BlockId>> allocate_slots(const RequestId& id, int num_new_tokens,
                                                         int num_lookahead = 0,
                                                         const ComputedBlocks* computed = nullptr);
  std::optional<std::span<const BlockId>> allocate_slots(RequestHandle handle, int num_new_tokens,
                                                         int num_lookahead = 0,
                                                         const ComputedBlocks* computed = nullptr);

  // Takes back the scheduling of a request's tokens from position num_computed_tokens
  // on (their KV will not be computed: the step was cancelled, or draft tokens were
  // rejected): num_computed_tokens is lowered and blocks that were cached on the
  // strength of those tokens leave the prefix cache. Blocks stay allocated. Throws
  // UnknownRequest, InvalidArgument unless 0 <= num_computed_tokens <= the current count
  // and every block the positions from there on can read is still held (a window's
  // released blocks are not brought back).
  void rollback(const RequestId& id, int num_computed_tokens);
  // Releases a request's blocks (last block first, so that prompt heads, the most
  // shareable, are evicted last) and forgets it. Throws UnknownRequest, so freeing twice
  // is an error.
  void free(const RequestId& id);
  // Makes `child` a copy of `parent` that shares all its blocks (and, with a state slot,
  // takes a slot of its own, its parent's state queued to be copied into it). Throws
  // UnknownRequest for parent, InvalidArgument if child exists, InvalidState where no
  // state slot is free.
  void fork(const RequestId& parent, const RequestId& child);
  // Block copies (src, dst) that copy-on-write queued since the last call.
  std::vector<std::pair<BlockId, BlockId>> take_pending_copies();
  // A request's recurrent-state slot (-1: not allocated yet, or no states kept). Throws
  // UnknownRequest.
  int state_slot(const RequestId& id) const;
  int state_slot(RequestHandle handle) const;
  int num_free_state_slots() const { return static_cast<int>(free_state_slots_.size()); }
  // State copies (src slot, dst slot) that fork queued since the last call: a child's
  // state starts as its parent's, once the parent's state holds its tokens (the model
  // runner copies it after the step that forks, before the next).
  std::vector<std::pair<int, int>> take_pending_state_copies();
  // With checkpoints: the checkpoint saves queued since the last call are among those
  // copies (a request's slot into a checkpoint, after the step), and a hit taken since
  // then queued a load (the checkpoint into the request's slot) to run before the step:
  std::vector<std::pair<int, int>> take_pending_state_loads();
  // With state_snapshots: a request's state saved into its snapshot slot before the
  // step (queued among the loads), or put back from it before the next. Throws
  // UnknownRequest, InvalidState without snapshots or before the request has a slot.
  void snapshot_state(RequestHandle handle);
  void restore_state(RequestHandle handle);
  // n of a request's lookahead slots become computed tokens (accepted drafts, whose KV
  // and state the step that verified them computed): allocate_slots(n), but with no
  // state checkpoint, which would copy the state only after the next step.
  std::optional<std::span<const BlockId>> accept_lookahead(RequestHandle handle, int n);
  int num_state_checkpoints_held() const { return static_cast<int>(checkpoint_of_.size()); }
  // Drops every cache entry, in both tiers; false (and nothing changed) while any block
  // is in use.
  bool reset_prefix_cache();

  // Preemption by swapping (a host tier only): copies every block of a request to host
  // blocks it holds and releases its device blocks; its tokens and num_computed_tokens
  // stay, and its next allocate_slots (with no computed blocks) copies them back. A block
  // this step's copy-on-write fills is copied out from its source (and that copy
  // dropped); a request holding a block this step copies in from the host cannot be
  // swapped out. Throws UnknownRequest, InvalidState unless can_swap_out.
  bool can_swap_out(const RequestId& id) const;
  void swap_out(const RequestId& id);
  bool is_swapped(const RequestId& id) const { return find(id).swapped; }
  // The copies between the tiers queued since the last call; the host blocks they read
  // or write are held until then.
  KVTransfers take_pending_transfers();
  const BlockPool* host_pool() const { return host_ ? &*host_ : nullptr; }

  // A group's block table (group 0's without one); kNoBlock where a block was released.
  std::span<const BlockId> block_table(const RequestId& id, int group = 0) const;
  std::span<const BlockId> block_table(RequestHandle handle, int group = 0) const;
  std::span<const TokenId> token_ids(const RequestId& id) const;
  int num_computed_tokens(const RequestId& id) const;
  KVCacheStats stats() const;
  const BlockPool& pool() const { return pool_; }

 private:
  // A request's blocks of one group.
  struct GroupTable {
    std::vector<BlockId> blocks;  // by logical block; kNoBlock where released
    std::vector<BlockId> host;    // swapped out: the host copies (kNoBlock where none)
    int num_released = 0;         // leading entries of blocks that are kNoBlock
    int num_cached = 0;           // leading entries in the prefix index (or released)
    BlockLink cached_tail;        // the entry of block num_cached - 1 when it was cached
    bool caching_stopped = false;  // a rollback lost the tail's entry: cache no more
    BlockExtras extras;            // the request's, with this group's kv_group
  };

  struct Request {
    std::vector<TokenId> token_ids;
    std::vector<GroupTable> groups;
    std::vector<BlockKey> block_keys;  // group 0's keys of the full blocks of token_ids
    int num_computed_tokens = 0;
    uint64_t extras_hash = 0;
    uint32_t generation = 0;  // bumped each time the slot takes a request
    bool in_use = false;
    bool swapped = false;
    bool lookup_counted = false;  // in the prefix-cache statistics already
    int state_slot = -1;          // the recurrent-state slot (-1: none)
    int num_prompt_tokens = 0;
  };

  // What an allocation needs of one group.
  struct GroupPlan {
    int first_needed = 0;            // blocks before it are released (or never taken)
    int num_new_blocks = 0;
    std::vector<int> copy_on_write;  // block-table indices to copy before writing
  };

  // What an allocation needs from the pool, computed without changing anything.
  struct Plan {
    int first_new_token = 0;
    bool has_hit = false;
    int num_free_hits = 0;  // hit blocks that are free now and leave the free list
    int num_copied_in = 0;  // device blocks for host hits and swapped-out blocks
    std::array<GroupPlan, kMaxKVGroups> groups;
    bool fits = false;
  };

  size_t slot_of(const RequestId& id) const;
  Request& find(const RequestId& id) { return requests_[slot_of(id)]; }
  const Request& find(const RequestId& id) const { return requests_[slot_of(id)]; }
  const Request& find(RequestHandle handle) const;
  Request& find(RequestHandle handle) {
    return const_cast<Request&>(std::as_const(*this).find(handle));
  }
  std::optional<std::span<const BlockId>> allocate(Request& request, int num_new_tokens,
                                                   int num_lookahead,
                                                   const ComputedBlocks* computed,
                                                   bool checkpoint = true);
  // The snapshot slot of a request's state slot (state_snapshots).
  int snapshot_slot(const Request& request, const char* op) const;
  void append(Request& request, std::span<const TokenId> token_ids);
  size_t take_free_slot();
  // Fills a free slot with `fill`, then registers it under `id`; if anything throws,
  // the slot goes back and nothing has changed.
  template <typename Fill>
  void register_request(const RequestId& id, Fill&& fill);
  BlockKey group_key(const Request& request, int group, size_t block_index) const;
  bool is_verified_hit(const BlockPool& pool, const Request& request, int group,
                       size_t block_index, BlockId block, const BlockLink& parent) const;
  static bool has_blocks(const Request& request);
  // Releases a group's blocks before `first_needed` (last first).
  void release_before(GroupTable& table, int first_needed);
  void take_hit(Request& request, const ComputedBlocks& computed);
  void swap_in(Request& request, const Plan& p);
  // A device block for a new use: before allocation evicts a cached block, the host
  // tier takes a copy of it (offload).
  BlockId take_block();
  void offload(BlockId block);
  // The device block that holds `block`'s content when the step's first copies run:
  // itself, the source of the copy-on-write that fills it, or none where the step
  // copies it in from the host tier.
  std::optional<BlockId> content_at_step_start(BlockId block) const;
  // Host hit `host_block` as block `block_index` of `request`'s `group`: copied into a
  // new device block, cached there under the same entry.
  BlockId copy_in_hit(Request& request, int group, size_t block_index, BlockId host_block,
                      const BlockLink& parent);
  Plan plan(const Request& request, int num_new_tokens, int num_lookahead,
            const ComputedBlocks* computed) const;
  std::span<const TokenId> block_tokens(const Request& request, size_t block_index) const;
  void extend_block_keys(Request& request);
  void cache_full_blocks(Request& request);
  // Whether a request's state is checkpointed where an allocation ends `end` tokens in
  // (a block boundary): every state_checkpoint_interval blocks and at the prompt's last
  // full block.
  bool checkpoints_at(const Request& request, int end) const;
  // A checkpoint of the request's state at the end of block `block_index`, which this
  // allocation completed, if the block is cached and has none yet.
  void save_checkpoint(const Request& request, size_t block_index);
  // The checkpoint of a block whose cache entry is gone, released.
  void drop_checkpoint(BlockId block);

  KVCacheConfig config_;
  BlockPool pool_;
  std::optional<BlockPool> host_;
  // Requests live in reused slots: a new request's vectors keep the capacity of the one
  // before it, so a steady stream of requests allocates almost nothing.
  std::unordered_map<RequestId, size_t> request_slots_;
  std::vector<Request> requests_;
  std::vector<size_t> free_slots_;
  std::vector<std::pair<BlockId, BlockId>> pending_copies_;
  std::vector<int> free_state_slots_;  // the lowest last (taken first)
  std::vector<std::pair<int, int>> pending_state_copies_;
  std::vector<std::pair<int, int>> pending_state_loads_;
  // Checkpoints: each one's block (kNoBlock: none), the blocks' (hits read these), and
  // those saved since the last take_pending_state_copies, whose copies have not run
  // (no hit may read them before the step that writes them).
  std::vector<BlockId> checkpoint_block_;
  std::unordered_map<BlockId, int> checkpoint_of_;
  std::unordered_map<BlockId, int> unpublished_checkpoints_;
  int next_checkpoint_ = 0;
  KVTransfers pending_transfers_;
  std::vector<BlockId> held_host_blocks_;  // released by take_pending_transfers
  int64_t prefix_cache_queries_ = 0;
  int64_t prefix_cache_hits_ = 0;
  int64_t host_cache_hits_ = 0;
  int64_t num_blocks_offloaded_ = 0;
  int64_t num_blocks_swapped_out_ = 0;
  int num_swapped_requests_ = 0;
};

}  // namespace pyengine
