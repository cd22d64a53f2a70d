#include "pyengine/kv_cache_manager.h"

#include <algorithm>
#include <string>

#include "pyengine/errors.h"

namespace pyengine {
namespace {

// Token positions are ints throughout (as in the scheduler's flat int32 inputs).
constexpr size_t kMaxTokensPerRequest = 1u << 30;

void check_token_ids(std::span<const TokenId> token_ids, const char* what) {
  TokenId smallest = 0;  // a branch-free minimum vectorizes
  for (const TokenId t : token_ids) smallest = std::min(smallest, t);
  if (smallest < 0) {
    throw InvalidArgument(std::string(what) + ": token id " + std::to_string(smallest) +
                          " is negative");
  }
}

}  // namespace

KVCacheManager::KVCacheManager(const KVCacheConfig& config)
    : config_(config), pool_(config.num_blocks, config.block_size) {
  check_argument(config.num_host_blocks >= 0, "num_host_blocks must be non-negative");
  if (config.num_host_blocks > 0) host_.emplace(config.num_host_blocks, config.block_size);
}

size_t KVCacheManager::slot_of(const RequestId& id) const {
  const auto it = request_slots_.find(id);
  if (it == request_slots_.end()) throw UnknownRequest(id);
  return it->second;
}

size_t KVCacheManager::take_free_slot() {
  if (free_slots_.empty()) {
    // Reserving for every slot here keeps free()'s push_back from ever allocating.
    free_slots_.reserve(requests_.size() + 1);
    requests_.emplace_back();
    return requests_.size() - 1;
  }
  const size_t slot = free_slots_.back();
  free_slots_.pop_back();
  return slot;
}

RequestHandle KVCacheManager::handle(const RequestId& id) const {
  const size_t slot = slot_of(id);
  return {static_cast<uint32_t>(slot), requests_[slot].generation};
}

const KVCacheManager::Request& KVCacheManager::find(RequestHandle handle) const {
  if (handle.slot >= requests_.size() || !requests_[handle.slot].in_use ||
      requests_[handle.slot].generation != handle.generation) {
    throw InvalidArgument("stale request handle (the request was freed)");
  }
  return requests_[handle.slot];
}

template <typename Fill>
void KVCacheManager::register_request(const RequestId& id, Fill&& fill) {
  const size_t slot = take_free_slot();
  try {
    fill(requests_[slot]);
    request_slots_.emplace(id, slot);
    requests_[slot].in_use = true;
    ++requests_[slot].generation;
  } catch (...) {
    free_slots_.push_back(slot);  // the id was never registered: nothing changed
    throw;
  }
}

void KVCacheManager::add_request(const RequestId& id, std::span<const TokenId> prompt_token_ids,
                                 BlockExtras extras) {
  check_argument(!prompt_token_ids.empty(), "add_request: the prompt is empty");
  check_argument(prompt_token_ids.size() <= kMaxTokensPerRequest,
                 "add_request: the prompt has more than 2**30 tokens");
  check_token_ids(prompt_token_ids, "add_request");
  if (has_request(id)) {
    throw InvalidArgument("add_request: request id '" + id + "' already exists");
  }
  register_request(id, [&](Request& request) {
    request.token_ids.assign(prompt_token_ids.begin(), prompt_token_ids.end());
    request.block_table.clear();
    request.host_table.clear();
    request.block_keys.clear();
    request.num_computed_tokens = 0;
    request.num_cached_blocks = 0;
    request.lookup_counted = false;
    request.extras_hash = hash_extras(extras);
    request.extras = extras;
    extend_block_keys(request);
  });
}

void KVCacheManager::append_token_ids(const RequestId& id, std::span<const TokenId> token_ids) {
  append(find(id), token_ids);
}

void KVCacheManager::append_token_ids(RequestHandle handle, std::span<const TokenId> token_ids) {
  append(find(handle), token_ids);
}

void KVCacheManager::append(Request& request, std::span<const TokenId> token_ids) {
  check_token_ids(token_ids, "append_token_ids");
  check_argument(token_ids.size() <= kMaxTokensPerRequest - request.token_ids.size(),
                 "append_token_ids: the request would have more than 2**30 tokens");
  request.token_ids.insert(request.token_ids.end(), token_ids.begin(), token_ids.end());
}

std::span<const TokenId> KVCacheManager::block_tokens(const Request& request,
                                                      size_t block_index) const {
  const auto size = static_cast<size_t>(config_.block_size);
  return std::span<const TokenId>(request.token_ids).subspan(block_index * size, size);
}

void KVCacheManager::extend_block_keys(Request& request) {
  if (!config_.enable_prefix_caching) return;
  const auto size = static_cast<size_t>(config_.block_size);
  const size_t have = request.block_keys.size();
  const size_t want = request.token_ids.size() / size;
  if (want <= have) return;
  const BlockKey parent = have == 0 ? kRootBlockKey : request.block_keys[have - 1];
  request.block_keys.resize(want);
  hash_blocks(
      std::span<const TokenId>(request.token_ids).subspan(have * size, (want - have) * size),
      config_.block_size, request.extras_hash, parent,
      std::span<BlockKey>(request.block_keys).subspan(have));
}

bool KVCacheManager::is_verified_hit(const BlockPool& pool, const Request& request,
                                     size_t block_index, BlockId block,
                                     const BlockLink& parent) const {
  return pool.is_cached(block) && pool.key(block) == request.block_keys[block_index] &&
         pool.verify(block, block_tokens(request, block_index), parent, request.extras);
}

ComputedBlocks KVCacheManager::get_computed_blocks(const RequestId& id) {
  Request& request = find(id);
  if (!request.block_table.empty() || !request.host_table.empty()) {
    throw InvalidState("get_computed_blocks: request '" + id + "' already has blocks");
  }
  ComputedBlocks computed;
  if (!config_.enable_prefix_caching) return computed;
  extend_block_keys(request);
  // At least one token is left to compute: its forward pass produces the next logits.
  const size_t max_blocks = (request.token_ids.size() - 1) / static_cast<size_t>(block_size());
  BlockLink parent;
  size_t i = 0;
  for (; i < max_blocks; ++i) {
    const auto block = pool_.lookup(request.block_keys[i]);
    if (!block || !is_verified_hit(pool_, request, i, *block, parent)) break;
    computed.block_ids.push_back(*block);
    parent = pool_.link(*block);
  }
  // Where the device's prefix ends, the host tier may hold the rest of it.
  for (; host_ && i < max_blocks; ++i) {
    const auto block = host_->lookup(request.block_keys[i]);
    if (!block || !is_verified_hit(*host_, request, i, *block, parent)) break;
    computed.host_block_ids.push_back(*block);
    parent = host_->link(*block);
  }
  computed.num_computed_tokens = static_cast<int>(i) * block_size();
  computed.num_host_tokens = static_cast<int>(computed.host_block_ids.size()) * block_size();
  if (!request.lookup_counted) {
    request.lookup_counted = true;
    prefix_cache_queries_ += static_cast<int64_t>(request.token_ids.size());
    prefix_cache_hits_ += computed.num_computed_tokens;
    host_cache_hits_ += computed.num_host_tokens;
  }
  return computed;
}

KVCacheManager::Plan KVCacheManager::plan(const Request& request, int num_new_tokens,
                                          int num_lookahead, const ComputedBlocks* computed) const {
  check_argument(num_new_tokens > 0, "allocate_slots: num_new_tokens must be positive");
  check_argument(num_lookahead >= 0, "allocate_slots: num_lookahead must be non-negative");
  Plan p;
  const int64_t size = block_size();
  const bool has_hit = computed != nullptr &&
                       (!computed->block_ids.empty() || !computed->host_block_ids.empty());
  if (has_hit) {
    if (!request.block_table.empty() || !request.host_table.empty()) {
      throw InvalidArgument("allocate_slots: computed blocks are taken by a first allocation only");
    }
    const size_t num_device = computed->block_ids.size();
    const auto num_hit = static_cast<int64_t>(num_device + computed->host_block_ids.size());
    check_argument(computed->num_computed_tokens == num_hit * size &&
                       num_hit <= static_cast<int64_t>(request.block_keys.size()) &&
                       (computed->host_block_ids.empty() || host_),
                   "allocate_slots: computed blocks do not match the request");
    // Verified again, not trusted: the blocks may have been evicted and re-cached
    // with other content since get_computed_blocks.
    const auto stale = [](BlockId b) {
      return InvalidArgument("allocate_slots: computed blocks are stale (block " +
                             std::to_string(b) + " no longer caches this prefix)");
    };
    BlockLink parent;
    for (size_t i = 0; i < num_device; ++i) {
      const BlockId b = computed->block_ids[i];
      if (!is_verified_hit(pool_, request, i, b, parent)) throw stale(b);
      if (pool_.ref_count(b) == 0) ++p.num_free_hits;
      parent = pool_.link(b);
    }
    for (size_t j = 0; j < computed->host_block_ids.size(); ++j) {
      const BlockId h = computed->host_block_ids[j];
      // (a device block that caches the key since would keep the copy from being cached)
      if (!is_verified_hit(*host_, request, num_device + j, h, parent) ||
          pool_.lookup(request.block_keys[num_device + j])) {
        throw stale(h);
      }
      parent = host_->link(h);
    }
    p.num_copied_in = static_cast<int>(computed->host_block_ids.size());
  }
  p.num_copied_in += static_cast<int>(request.host_table.size());
  p.first_new_token = has_hit ? computed->num_computed_tokens : request.num_computed_tokens;
  const int64_t end = static_cast<int64_t>(p.first_new_token) + num_new_tokens;
  if (end > static_cast<int64_t>(request.token_ids.size())) {
    throw InvalidArgument("allocate_slots: " + std::to_string(num_new_tokens) +
                          " new tokens after " + std::to_string(p.first_new_token) +
                          " computed, but only " + std::to_string(request.token_ids.size()) +
                          " tokens are known");
  }
  const int64_t num_slots = end + num_lookahead;
  const int64_t num_blocks_needed = (num_slots + size - 1) / size;
  const int64_t num_held = static_cast<int64_t>(request.block_table.size()) +
                           (has_hit ? static_cast<int64_t>(computed->block_ids.size()) : 0) +
                           p.num_copied_in;
  const int64_t num_new_blocks = std::max<int64_t>(0, num_blocks_needed - num_held);
  const int64_t last_written =
      std::min<int64_t>(num_blocks_needed, static_cast<int64_t>(request.block_table.size()));
  for (int64_t i = p.first_new_token / size; i < last_written; ++i) {
    if (pool_.ref_count(request.block_table[static_cast<size_t>(i)]) > 1) {
      p.copy_on_write.push_back(static_cast<int>(i));
    }
  }
  const int64_t num_taken = num_new_blocks + static_cast<int64_t>(p.copy_on_write.size()) +
                            p.num_free_hits + p.num_copied_in;
  p.fits = num_taken <= pool_.num_free_blocks();
  if (p.fits) p.num_new_blocks = static_cast<int>(num_new_blocks);  // bounded by the pool
  return p;
}

bool KVCacheManager::can_allocate_slots(const RequestId& id, int num_new_tokens, int num_lookahead,
                                        const ComputedBlocks* computed) const {
  return plan(find(id), num_new_tokens, num_lookahead, computed).fits;
}

std::optional<std::span<const BlockId>> KVCacheManager::allocate_slots(
    const RequestId& id, int num_new_tokens, int num_lookahead, const ComputedBlocks* computed) {
  return allocate(find(id), num_new_tokens, num_lookahead, computed);
}

std::optional<std::span<const BlockId>> KVCacheManager::allocate_slots(
    RequestHandle handle, int num_new_tokens, int num_lookahead, const ComputedBlocks* computed) {
  return allocate(find(handle), num_new_tokens, num_lookahead, computed);
}

std::optional<std::span<const BlockId>> KVCacheManager::allocate(Request& request,
                                                                 int num_new_tokens,
                                                                 int num_lookahead,
                                                                 const ComputedBlocks* computed) {
  const Plan p = plan(request, num_new_tokens, num_lookahead, computed);
  if (!p.fits) return std::nullopt;

  const int size = block_size();
  if (computed != nullptr && computed->num_computed_tokens > 0) {
    for (const BlockId b : computed->block_ids) {
      pool_.retain(b);
      request.block_table.push_back(b);
    }
    // Held first: taking device blocks below may offload into the host tier, which must
    // not evict them.
    for (const BlockId h : computed->host_block_ids) host_->retain(h);
    for (const BlockId h : computed->host_block_ids) {
      const size_t i = request.block_table.size();
      const BlockLink parent = i == 0 ? BlockLink{} : pool_.link(request.block_table[i - 1]);
      request.block_table.push_back(copy_in_hit(request, i, h, parent));
    }
    request.num_computed_tokens = computed->num_computed_tokens;
    request.num_cached_blocks = static_cast<int>(request.block_table.size());
  }
  // A swapped-out request's blocks come back (its host blocks, held, are released once
  // the copies are taken).
  for (size_t i = 0; i < request.host_table.size(); ++i) {
    const BlockId block = take_block();
    pool_.set_num_filled(block, std::clamp(request.num_computed_tokens - static_cast<int>(i) * size,
                                           0, size));
    pending_transfers_.to_device.emplace_back(request.host_table[i], block);
    held_host_blocks_.push_back(request.host_table[i]);
    request.block_table.push_back(block);
  }
  if (!request.host_table.empty()) --num_swapped_requests_;
  request.host_table.clear();
  for (const int i : p.copy_on_write) {
    const BlockId shared = request.block_table[static_cast<size_t>(i)];
    const BlockId copy = take_block();
    pool_.set_num_filled(copy, pool_.num_filled(shared));
    pending_copies_.emplace_back(shared, copy);
    pool_.release(shared);
    request.block_table[static_cast<size_t>(i)] = copy;
  }
  for (int i = 0; i < p.num_new_blocks; ++i) request.block_table.push_back(take_block());

  const int end = p.first_new_token + num_new_tokens;
  for (int i = p.first_new_token / size; i * size < end; ++i) {
    pool_.set_num_filled(request.block_table[static_cast<size_t>(i)],
                         std::min(size, end - i * size));
  }
  request.num_computed_tokens = end;
  cache_full_blocks(request);
  return std::span<const BlockId>(request.block_table).last(static_cast<size_t>(p.num_new_blocks));
}

void KVCacheManager::cache_full_blocks(Request& request) {
  if (!config_.enable_prefix_caching) return;
  extend_block_keys(request);
  const auto num_full = static_cast<size_t>(request.num_computed_tokens / block_size());
  while (static_cast<size_t>(request.num_cached_blocks) < num_full) {
    const auto i = static_cast<size_t>(request.num_cached_blocks);
    const BlockLink parent = i == 0 ? BlockLink{} : pool_.link(request.block_table[i - 1]);
    // False when another block already caches this prefix; this request's later
    // blocks then stay uncached, so that every cached block's parent is cached.
    if (!pool_.cache(request.block_table[i], request.block_keys[i], block_tokens(request, i),
                     parent, request.extras)) {
      break;
    }
    ++request.num_cached_blocks;
  }
}

void KVCacheManager::rollback(const RequestId& id, int num_computed_tokens) {
  Request& request = find(id);
  if (!request.host_table.empty()) {
    throw InvalidState("rollback: request '" + id + "' is swapped out");
  }
  check_argument(num_computed_tokens >= 0 && num_computed_tokens <= request.num_computed_tokens,
                 "rollback: num_computed_tokens must be in [0, the request's current count]");
  const int size = block_size();
  const int num_full = num_computed_tokens / size;
  // Blocks this request cached that now hold uncomputed positions. Only blocks it holds
  // alone may be given back: a block another table holds too (a prefix hit) is that
  // request's cached content as well.
  for (int i = num_full; i < request.num_cached_blocks; ++i) {
    check_argument(pool_.ref_count(request.block_table[static_cast<size_t>(i)]) == 1,
                   "rollback: num_computed_tokens is inside blocks other requests share");
  }
  for (int i = num_full; i < request.num_cached_blocks; ++i) {
    pool_.uncache(request.block_table[static_cast<size_t>(i)]);
  }
  request.num_cached_blocks = std::min(request.num_cached_blocks, num_full);
  for (int i = num_full; i * size < request.num_computed_tokens; ++i) {
    pool_.set_num_filled(request.block_table[static_cast<size_t>(i)],
                         std::clamp(num_computed_tokens - i * size, 0, size));
  }
  request.num_computed_tokens = num_computed_tokens;
}

void KVCacheManager::free(const RequestId& id) {
  const auto it = request_slots_.find(id);
  if (it == request_slots_.end()) throw UnknownRequest(id);
  const size_t slot = it->second;
  request_slots_.erase(it);
  requests_[slot].in_use = false;
  free_slots_.push_back(slot);  // capacity reserved: cannot throw. Cleared on reuse.
  const auto& table = requests_[slot].block_table;
  for (auto b = table.rbegin(); b != table.rend(); ++b) pool_.release(*b);
  const auto& host_table = requests_[slot].host_table;
  for (const BlockId h : host_table) host_->release(h);
  if (!host_table.empty()) --num_swapped_requests_;
}

void KVCacheManager::fork(const RequestId& parent, const RequestId& child) {
  const size_t source = slot_of(parent);
  if (!requests_[source].host_table.empty()) {
    throw InvalidState("fork: request '" + parent + "' is swapped out");
  }
  if (has_request(child)) {
    throw InvalidArgument("fork: request id '" + child + "' already exists");
  }
  // Index, don't hold references: taking a slot may grow requests_.
  register_request(child, [&](Request& copy) {
    const uint32_t generation = copy.generation;  // the slot's own count, not the source's
    copy = requests_[source];
    copy.generation = generation;
  });
  for (const BlockId b : requests_[slot_of(child)].block_table) pool_.retain(b);
}

std::vector<std::pair<BlockId, BlockId>> KVCacheManager::take_pending_copies() {
  return std::exchange(pending_copies_, {});
}

bool KVCacheManager::reset_prefix_cache() {
  // (the host tier first: it can refuse, and then nothing may have changed)
  if (host_ && (host_->num_free_blocks() < host_->num_blocks() ||
                pool_.num_free_blocks() < pool_.num_blocks())) {
    return false;
  }
  return pool_.reset_prefix_cache() && (!host_ || host_->reset_prefix_cache());
}

std::span<const BlockId> KVCacheManager::block_table(const RequestId& id) const {
  return find(id).block_table;
}

std::span<const BlockId> KVCacheManager::block_table(RequestHandle handle) const {
  return find(handle).block_table;
}

std::span<const TokenId> KVCacheManager::token_ids(const RequestId& id) const {
  return find(id).token_ids;
}

int KVCacheManager::num_computed_tokens(const RequestId& id) const {
  return find(id).num_computed_tokens;
}

KVCacheStats KVCacheManager::stats() const {
  KVCacheStats s;
  s.num_blocks = pool_.num_blocks();
  s.num_free_blocks = pool_.num_free_blocks();
  s.num_used_blocks = s.num_blocks - s.num_free_blocks;
  s.num_cached_blocks = pool_.num_cached_blocks();
  s.usage = static_cast<double>(s.num_used_blocks) / s.num_blocks;
  s.prefix_cache_queries = prefix_cache_queries_;
  s.prefix_cache_hits = prefix_cache_hits_;
  s.num_evictions = pool_.num_evictions();
  s.internal_waste_tokens =
      static_cast<int64_t>(s.num_used_blocks) * block_size() - pool_.num_filled_slots_in_use();
  if (host_) {
    s.num_host_blocks = host_->num_blocks();
    s.num_host_used_blocks = host_->num_blocks() - host_->num_free_blocks();
    s.num_host_cached_blocks = host_->num_cached_blocks();
  }
  s.host_cache_hits = host_cache_hits_;
  s.num_blocks_offloaded = num_blocks_offloaded_;
  s.num_blocks_swapped_out = num_blocks_swapped_out_;
  s.num_swapped_requests = num_swapped_requests_;
  return s;
}

}  // namespace pyengine
