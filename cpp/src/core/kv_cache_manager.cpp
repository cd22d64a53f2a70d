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
  if (config_.groups.empty()) config_.groups.emplace_back();
  if (config_.groups.size() > static_cast<size_t>(kMaxKVGroups)) {
    throw InvalidArgument("at most " + std::to_string(kMaxKVGroups) + " KV-cache groups, got " +
                          std::to_string(config_.groups.size()));
  }
  for (const KVGroupSpec& spec : config_.groups) {
    if (spec.kind == KVGroupKind::kFull ? spec.size != 0 : spec.size <= 0) {
      throw InvalidArgument(std::string("a ") + kv_group_kind_name(spec.kind) +
                            " KV-cache group's size must be " +
                            (spec.kind == KVGroupKind::kFull ? "0" : "positive") + ", got " +
                            std::to_string(spec.size));
    }
  }
  if (config.num_host_blocks > 0) host_.emplace(config.num_host_blocks, config.block_size);
  check_argument(config.num_state_slots >= 0, "num_state_slots must be non-negative");
  check_argument(config.num_state_checkpoints >= 0, "num_state_checkpoints must be non-negative");
  if (config.num_state_slots > 0 && config.enable_prefix_caching &&
      config.num_state_checkpoints == 0) {
    throw InvalidArgument(
        "prefix caching with recurrent-state slots needs num_state_checkpoints > 0 (a hit "
        "resumes a state from one)");
  }
  if (config.num_state_checkpoints > 0) {
    check_argument(config.num_state_slots > 0 && config.enable_prefix_caching,
                   "num_state_checkpoints needs state slots and prefix caching");
    check_argument(!host_ && config_.groups.size() == 1,
                   "state checkpoints are kept with one KV-cache group and no host tier");
  }
  check_argument(!config.state_snapshots || config.num_state_slots > 0,
                 "state_snapshots needs state slots");
  if (config.state_checkpoint_interval < 1) {
    throw InvalidArgument("state_checkpoint_interval must be at least 1 (blocks), got " +
                          std::to_string(config.state_checkpoint_interval));
  }
  checkpoint_block_.assign(static_cast<size_t>(config.num_state_checkpoints), kNoBlock);
  free_state_slots_.reserve(static_cast<size_t>(config.num_state_slots));
  for (int slot = config.num_state_slots - 1; slot >= 0; --slot) free_state_slots_.push_back(slot);
}

int64_t KVCacheManager::max_blocks_held(int64_t num_tokens, int64_t max_step_tokens) const {
  return pyengine::max_blocks_held(config_.groups, block_size(), num_tokens, max_step_tokens);
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
    request.num_prompt_tokens = static_cast<int>(prompt_token_ids.size());
    request.groups.resize(config_.groups.size());
    for (size_t g = 0; g < request.groups.size(); ++g) {
      GroupTable& table = request.groups[g];
      table.blocks.clear();
      table.host.clear();
      table.num_released = table.num_cached = 0;
      table.cached_tail = {};
      table.caching_stopped = false;
      table.extras = extras;
      table.extras.kv_group = static_cast<int>(g);
    }
    request.block_keys.clear();
    request.num_computed_tokens = 0;
    request.swapped = false;
    request.lookup_counted = false;
    request.state_slot = -1;
    request.extras_hash = hash_extras(extras);
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

BlockKey KVCacheManager::group_key(const Request& request, int group, size_t block_index) const {
  // Another group's key for the same prefix: only a lookup hint (hits are verified, and
  // a first block's extras name its group), so any cheap derivation serves.
  const BlockKey key = request.block_keys[block_index];
  const auto g = static_cast<uint64_t>(group);
  return {key.hi ^ (g * 0x9E3779B97F4A7C15ull), key.lo + g};
}

bool KVCacheManager::is_verified_hit(const BlockPool& pool, const Request& request, int group,
                                     size_t block_index, BlockId block,
                                     const BlockLink& parent) const {
  return pool.is_cached(block) && pool.key(block) == group_key(request, group, block_index) &&
         pool.verify(block, block_tokens(request, block_index), parent,
                     request.groups[static_cast<size_t>(group)].extras);
}

bool KVCacheManager::has_blocks(const Request& request) {
  return request.swapped || std::ranges::any_of(request.groups, [](const GroupTable& t) {
           return !t.blocks.empty();
         });
}

ComputedBlocks KVCacheManager::get_computed_blocks(const RequestId& id) {
  Request& request = find(id);
  if (has_blocks(request)) {
    throw InvalidState("get_computed_blocks: request '" + id + "' already has blocks");
  }
  ComputedBlocks computed;
  if (!config_.enable_prefix_caching) return computed;
  extend_block_keys(request);
  const int num_groups = this->num_groups();
  // At least one token is left to compute: its forward pass produces the next logits.
  size_t n = (request.token_ids.size() - 1) / static_cast<size_t>(block_size());
  // Each group's verified chain, device blocks then the host tier's, no longer than the
  // groups before it verified.
  std::vector<std::vector<BlockId>> chains(static_cast<size_t>(num_groups));
  std::vector<size_t> on_device(static_cast<size_t>(num_groups));
  for (int g = 0; g < num_groups; ++g) {
    auto& chain = chains[static_cast<size_t>(g)];
    BlockLink parent;
    size_t i = 0;
    for (; i < n; ++i) {
      const auto block = pool_.lookup(group_key(request, g, i));
      if (!block || !is_verified_hit(pool_, request, g, i, *block, parent)) break;
      chain.push_back(*block);
      parent = pool_.link(*block);
    }
    on_device[static_cast<size_t>(g)] = i;
    // Where the device's prefix ends, the host tier may hold the rest of it.
    for (; host_ && i < n; ++i) {
      const auto block = host_->lookup(group_key(request, g, i));
      if (!block || !is_verified_hit(*host_, request, g, i, *block, parent)) break;
      chain.push_back(*block);
      parent = host_->link(*block);
    }
    n = i;
  }
  if (config_.num_state_checkpoints > 0) {
    // A recurrent state resumes only from a checkpoint: the hit ends at the last block
    // whose prefix's state one holds (one group, all on the device).
    const auto& chain = chains[0];
    while (n > 0 && !checkpoint_of_.contains(chain[n - 1])) --n;
    if (n > 0) computed.state_checkpoint = config_.num_state_slots + checkpoint_of_.at(chain[n - 1]);
  }
  computed.num_computed_tokens = static_cast<int>(n) * block_size();
  computed.groups.resize(static_cast<size_t>(num_groups));
  size_t device_prefix = n;
  for (int g = 0; g < num_groups; ++g) {
    const auto& chain = chains[static_cast<size_t>(g)];
    const size_t device = std::min(n, on_device[static_cast<size_t>(g)]);
    device_prefix = std::min(device_prefix, device);
    GroupHit& hit = computed.groups[static_cast<size_t>(g)];
    const auto first = static_cast<size_t>(config_.groups[static_cast<size_t>(g)].first_needed_block(
        computed.num_computed_tokens, block_size()));
    hit.first_block = static_cast<int>(first);
    if (first > 0) {
      hit.parent = first - 1 < device ? pool_.link(chain[first - 1]) : host_->link(chain[first - 1]);
    }
    for (size_t i = first; i < n; ++i) {
      (i < device ? hit.block_ids : hit.host_block_ids).push_back(chain[i]);
    }
  }
  computed.num_host_tokens = static_cast<int>(n - device_prefix) * block_size();
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
  const int num_groups = this->num_groups();
  p.has_hit = computed != nullptr && computed->num_computed_tokens > 0;
  int64_t num_hit = 0;
  if (p.has_hit) {
    if (has_blocks(request)) {
      throw InvalidArgument("allocate_slots: computed blocks are taken by a first allocation only");
    }
    num_hit = computed->num_computed_tokens / size;
    check_argument(computed->num_computed_tokens % size == 0 &&
                       num_hit <= static_cast<int64_t>(request.block_keys.size()) &&
                       computed->groups.size() == static_cast<size_t>(num_groups),
                   "allocate_slots: computed blocks do not match the request");
    // Verified again, not trusted: the blocks may have been evicted and re-cached
    // with other content since get_computed_blocks.
    const auto stale = [](BlockId b) {
      return InvalidArgument("allocate_slots: computed blocks are stale (block " +
                             std::to_string(b) + " no longer caches this prefix)");
    };
    for (int g = 0; g < num_groups; ++g) {
      const GroupHit& hit = computed->groups[static_cast<size_t>(g)];
      const int64_t first = config_.groups[static_cast<size_t>(g)].first_needed_block(
          computed->num_computed_tokens, block_size());
      check_argument(hit.first_block == first &&
                         static_cast<int64_t>(hit.block_ids.size() + hit.host_block_ids.size()) ==
                             num_hit - first &&
                         (hit.host_block_ids.empty() || host_),
                     "allocate_slots: computed blocks do not match the request");
      BlockLink parent = hit.parent;
      auto i = static_cast<size_t>(first);
      for (const BlockId b : hit.block_ids) {
        if (!is_verified_hit(pool_, request, g, i++, b, parent)) throw stale(b);
        if (pool_.ref_count(b) == 0) ++p.num_free_hits;
        parent = pool_.link(b);
      }
      for (const BlockId h : hit.host_block_ids) {
        // (a device block that caches the key since would keep the copy from being cached)
        if (!is_verified_hit(*host_, request, g, i, h, parent) ||
            pool_.lookup(group_key(request, g, i))) {
          throw stale(h);
        }
        ++i;
        parent = host_->link(h);
      }
      p.num_copied_in += static_cast<int>(hit.host_block_ids.size());
    }
  }
  p.first_new_token = p.has_hit ? computed->num_computed_tokens : request.num_computed_tokens;
  const int64_t end = static_cast<int64_t>(p.first_new_token) + num_new_tokens;
  if (end > static_cast<int64_t>(request.token_ids.size())) {
    throw InvalidArgument("allocate_slots: " + std::to_string(num_new_tokens) +
                          " new tokens after " + std::to_string(p.first_new_token) +
                          " computed, but only " + std::to_string(request.token_ids.size()) +
                          " tokens are known");
  }
  const int64_t num_blocks_needed = (end + num_lookahead + size - 1) / size;
  int64_t num_taken = p.num_free_hits;
  int64_t num_released = 0;  // blocks that release_before returns to the free lists
  for (int g = 0; g < num_groups; ++g) {
    const GroupTable& table = request.groups[static_cast<size_t>(g)];
    GroupPlan& gp = p.groups[static_cast<size_t>(g)];
    gp.first_needed = static_cast<int>(
        config_.groups[static_cast<size_t>(g)].first_needed_block(p.first_new_token, block_size()));
    const auto num_held = static_cast<int64_t>(
        p.has_hit ? num_hit : (request.swapped ? table.host.size() : table.blocks.size()));
    const int64_t num_new_blocks = std::max<int64_t>(0, num_blocks_needed - num_held);
    num_taken += num_new_blocks;
    if (request.swapped) {
      for (auto i = static_cast<size_t>(gp.first_needed); i < table.host.size(); ++i) {
        p.num_copied_in += table.host[i] != kNoBlock ? 1 : 0;
      }
    }
    const auto written = static_cast<size_t>(std::min<int64_t>(
        num_blocks_needed, static_cast<int64_t>(table.blocks.size())));
    for (auto i = static_cast<size_t>(table.num_released);
         i < std::min(static_cast<size_t>(gp.first_needed), table.blocks.size()); ++i) {
      const BlockId b = table.blocks[i];
      num_released += b != kNoBlock && pool_.ref_count(b) == 1 ? 1 : 0;
    }
    for (auto i = static_cast<size_t>(p.first_new_token / size); i < written; ++i) {
      if (pool_.ref_count(table.blocks[i]) > 1) gp.copy_on_write.push_back(static_cast<int>(i));
    }
    num_taken += static_cast<int64_t>(gp.copy_on_write.size());
    gp.num_new_blocks = static_cast<int>(std::min<int64_t>(num_new_blocks, pool_.num_blocks()));
  }
  num_taken += p.num_copied_in;
  // (a request's first allocation takes a state slot too, where the manager keeps them)
  const bool state_fits =
      config_.num_state_slots == 0 || request.state_slot >= 0 || !free_state_slots_.empty();
  p.fits = num_taken <= pool_.num_free_blocks() + num_released && state_fits;
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

void KVCacheManager::release_before(GroupTable& table, int first_needed) {
  const int end = std::min(first_needed, static_cast<int>(table.blocks.size()));
  // Last first, as free() does: a chain's head, which every later hit must verify
  // through, is evicted last.
  for (int i = end - 1; i >= table.num_released; --i) {
    BlockId& b = table.blocks[static_cast<size_t>(i)];
    if (b != kNoBlock) pool_.release(std::exchange(b, kNoBlock));
  }
  table.num_released = std::max(table.num_released, end);
}

void KVCacheManager::take_hit(Request& request, const ComputedBlocks& computed) {
  const int num_hit = computed.num_computed_tokens / block_size();
  for (size_t g = 0; g < request.groups.size(); ++g) {
    const GroupHit& hit = computed.groups[g];
    GroupTable& table = request.groups[g];
    table.blocks.assign(static_cast<size_t>(hit.first_block), kNoBlock);
    table.num_released = hit.first_block;
    for (const BlockId b : hit.block_ids) {
      pool_.retain(b);
      table.blocks.push_back(b);
    }
    // Held first: taking device blocks below may offload into the host tier, which
    // must not evict them.
    for (const BlockId h : hit.host_block_ids) host_->retain(h);
  }
  for (size_t g = 0; g < request.groups.size(); ++g) {
    const GroupHit& hit = computed.groups[g];
    GroupTable& table = request.groups[g];
    for (const BlockId h : hit.host_block_ids) {
      const size_t i = table.blocks.size();
      const BlockLink parent = static_cast<int>(i) == hit.first_block
                                   ? hit.parent
                                   : pool_.link(table.blocks[i - 1]);
      table.blocks.push_back(copy_in_hit(request, static_cast<int>(g), i, h, parent));
    }
    table.num_cached = num_hit;
    table.cached_tail = num_hit > hit.first_block ? pool_.link(table.blocks.back()) : hit.parent;
  }
  request.num_computed_tokens = computed.num_computed_tokens;
}

std::optional<std::span<const BlockId>> KVCacheManager::allocate(Request& request,
                                                                 int num_new_tokens,
                                                                 int num_lookahead,
                                                                 const ComputedBlocks* computed,
                                                                 bool checkpoint) {
  const Plan p = plan(request, num_new_tokens, num_lookahead, computed);
  if (!p.fits) return std::nullopt;
  if (config_.num_state_slots > 0 && request.state_slot < 0) {
    request.state_slot = free_state_slots_.back();
    free_state_slots_.pop_back();
  }

  const int size = block_size();
  for (size_t g = 0; g < request.groups.size(); ++g) {
    release_before(request.groups[g], p.groups[g].first_needed);
  }
  if (p.has_hit) {
    take_hit(request, *computed);
    if (computed->state_checkpoint >= 0) {
      pending_state_loads_.emplace_back(computed->state_checkpoint, request.state_slot);
    }
  }
  if (request.swapped) swap_in(request, p);
  const int end = p.first_new_token + num_new_tokens;
  for (size_t g = 0; g < request.groups.size(); ++g) {
    auto& blocks = request.groups[g].blocks;
    for (const int i : p.groups[g].copy_on_write) {
      const BlockId shared = blocks[static_cast<size_t>(i)];
      const BlockId copy = take_block();
      pool_.set_num_filled(copy, pool_.num_filled(shared));
      pending_copies_.emplace_back(shared, copy);
      pool_.release(shared);
      blocks[static_cast<size_t>(i)] = copy;
    }
    for (int i = 0; i < p.groups[g].num_new_blocks; ++i) blocks.push_back(take_block());
    for (int i = p.first_new_token / size; i * size < end; ++i) {
      pool_.set_num_filled(blocks[static_cast<size_t>(i)], std::min(size, end - i * size));
    }
  }
  request.num_computed_tokens = end;
  cache_full_blocks(request);
  if (config_.num_state_checkpoints > 0 && checkpoint && num_lookahead == 0 &&
      checkpoints_at(request, end)) {
    save_checkpoint(request, static_cast<size_t>(end / block_size() - 1));
  }
  return std::span<const BlockId>(request.groups[0].blocks)
      .last(static_cast<size_t>(p.groups[0].num_new_blocks));
}

void KVCacheManager::cache_full_blocks(Request& request) {
  if (!config_.enable_prefix_caching) return;
  extend_block_keys(request);
  const int num_full = request.num_computed_tokens / block_size();
  for (size_t g = 0; g < request.groups.size(); ++g) {
    GroupTable& table = request.groups[g];
    while (!table.caching_stopped && table.num_cached < num_full) {
      const auto i = static_cast<size_t>(table.num_cached);
      const BlockId block = table.blocks[i];
      // False when another block already caches this prefix (or this one was released
      // uncached); this request's later blocks then stay uncached, so that every cached
      // block's parent is cached.
      if (block == kNoBlock ||
          !pool_.cache(block, group_key(request, static_cast<int>(g), i), block_tokens(request, i),
                       i == 0 ? BlockLink{} : table.cached_tail, table.extras)) {
        break;
      }
      table.cached_tail = pool_.link(block);
      ++table.num_cached;
    }
  }
}

bool KVCacheManager::checkpoints_at(const Request& request, int end) const {
  const int size = block_size();
  if (end % size != 0) return false;
  return (end / size) % config_.state_checkpoint_interval == 0 ||
         end == request.num_prompt_tokens / size * size;
}

void KVCacheManager::save_checkpoint(const Request& request, size_t block_index) {
  const GroupTable& table = request.groups[0];
  if (static_cast<size_t>(table.num_cached) <= block_index) return;  // (not cached)
  const BlockId block = table.blocks[block_index];
  if (checkpoint_of_.contains(block) || unpublished_checkpoints_.contains(block)) return;
  // The oldest checkpoint goes (its block may keep its KV, and a hit then ends earlier).
  const int c = next_checkpoint_;
  next_checkpoint_ = (c + 1) % config_.num_state_checkpoints;
  drop_checkpoint(checkpoint_block_[static_cast<size_t>(c)]);
  checkpoint_block_[static_cast<size_t>(c)] = block;
  unpublished_checkpoints_.emplace(block, c);
  pending_state_copies_.emplace_back(request.state_slot, config_.num_state_slots + c);
}

void KVCacheManager::drop_checkpoint(BlockId block) {
  if (block == kNoBlock || checkpoint_block_.empty()) return;
  for (auto* index : {&checkpoint_of_, &unpublished_checkpoints_}) {
    if (const auto it = index->find(block); it != index->end()) {
      checkpoint_block_[static_cast<size_t>(it->second)] = kNoBlock;
      index->erase(it);
    }
  }
}

void KVCacheManager::rollback(const RequestId& id, int num_computed_tokens) {
  Request& request = find(id);
  if (request.swapped) throw InvalidState("rollback: request '" + id + "' is swapped out");
  check_argument(num_computed_tokens >= 0 && num_computed_tokens <= request.num_computed_tokens,
                 "rollback: num_computed_tokens must be in [0, the request's current count]");
  const int size = block_size();
  const int num_full = num_computed_tokens / size;
  for (size_t g = 0; g < request.groups.size(); ++g) {
    const GroupTable& table = request.groups[g];
    const auto first = static_cast<int>(
        config_.groups[g].first_needed_block(num_computed_tokens, size));
    check_argument(first >= table.num_released,
                   "rollback: positions from num_computed_tokens on would read blocks a window "
                   "has released");
    // Blocks this request cached that now hold uncomputed positions. Only blocks it
    // holds alone may be given back: a block another table holds too (a prefix hit) is
    // that request's cached content as well.
    for (int i = num_full; i < table.num_cached; ++i) {
      check_argument(pool_.ref_count(table.blocks[static_cast<size_t>(i)]) == 1,
                     "rollback: num_computed_tokens is inside blocks other requests share");
    }
  }
  for (GroupTable& table : request.groups) {
    if (num_full < table.num_cached) {
      for (int i = num_full; i < table.num_cached; ++i) {
        pool_.uncache(table.blocks[static_cast<size_t>(i)]);
        drop_checkpoint(table.blocks[static_cast<size_t>(i)]);
      }
      table.num_cached = num_full;
      const BlockId tail = num_full == 0 ? kNoBlock : table.blocks[static_cast<size_t>(num_full - 1)];
      if (tail != kNoBlock) table.cached_tail = pool_.link(tail);
      table.caching_stopped = num_full > 0 && tail == kNoBlock;
    }
    for (int i = num_full; i * size < request.num_computed_tokens; ++i) {
      pool_.set_num_filled(table.blocks[static_cast<size_t>(i)],
                           std::clamp(num_computed_tokens - i * size, 0, size));
    }
  }
  request.num_computed_tokens = num_computed_tokens;
}

void KVCacheManager::free(const RequestId& id) {
  const auto it = request_slots_.find(id);
  if (it == request_slots_.end()) throw UnknownRequest(id);
  const size_t slot = it->second;
  request_slots_.erase(it);
  Request& request = requests_[slot];
  request.in_use = false;
  free_slots_.push_back(slot);  // capacity reserved: cannot throw. Cleared on reuse.
  for (const GroupTable& table : request.groups) {
    for (auto b = table.blocks.rbegin(); b != table.blocks.rend(); ++b) {
      if (*b != kNoBlock) pool_.release(*b);
    }
    for (const BlockId h : table.host) {
      if (h != kNoBlock) host_->release(h);
    }
  }
  if (request.swapped) --num_swapped_requests_;
  if (request.state_slot >= 0) {
    free_state_slots_.push_back(request.state_slot);  // capacity reserved: cannot throw
    request.state_slot = -1;
  }
}

void KVCacheManager::fork(const RequestId& parent, const RequestId& child) {
  const size_t source = slot_of(parent);
  if (requests_[source].swapped) {
    throw InvalidState("fork: request '" + parent + "' is swapped out");
  }
  if (has_request(child)) {
    throw InvalidArgument("fork: request id '" + child + "' already exists");
  }
  const int parent_state = requests_[source].state_slot;
  if (parent_state >= 0 && free_state_slots_.empty()) {
    throw InvalidState("fork: no recurrent-state slot is free for '" + child + "'");
  }
  // Index, don't hold references: taking a slot may grow requests_.
  register_request(child, [&](Request& copy) {
    const uint32_t generation = copy.generation;  // the slot's own count, not the source's
    copy = requests_[source];
    copy.generation = generation;
    copy.state_slot = -1;
  });
  if (parent_state >= 0) {
    Request& copy = requests_[slot_of(child)];
    copy.state_slot = free_state_slots_.back();
    free_state_slots_.pop_back();
    pending_state_copies_.emplace_back(parent_state, copy.state_slot);
  }
  for (const GroupTable& table : requests_[slot_of(child)].groups) {
    for (const BlockId b : table.blocks) {
      if (b != kNoBlock) pool_.retain(b);
    }
  }
}

std::vector<std::pair<BlockId, BlockId>> KVCacheManager::take_pending_copies() {
  return std::exchange(pending_copies_, {});
}

int KVCacheManager::state_slot(const RequestId& id) const { return find(id).state_slot; }
int KVCacheManager::state_slot(RequestHandle handle) const { return find(handle).state_slot; }

std::vector<std::pair<int, int>> KVCacheManager::take_pending_state_copies() {
  // The checkpoints saved so far are written by the step these copies follow: hits
  // from the next schedule on may read them.
  checkpoint_of_.merge(unpublished_checkpoints_);
  unpublished_checkpoints_.clear();
  auto copies = std::exchange(pending_state_copies_, {});
  // (a checkpoint reused twice in one step: its last save stands)
  for (size_t i = copies.size(); i-- > 0;) {
    for (size_t j = 0; j < i; ++j) {
      if (copies[j].second == copies[i].second) copies[j].second = -1;
    }
  }
  std::erase_if(copies, [](const auto& copy) { return copy.second < 0; });
  return copies;
}

std::optional<std::span<const BlockId>> KVCacheManager::accept_lookahead(RequestHandle handle,
                                                                         int n) {
  return allocate(find(handle), n, 0, nullptr, false);
}

int KVCacheManager::snapshot_slot(const Request& request, const char* op) const {
  if (!config_.state_snapshots || request.state_slot < 0) {
    throw InvalidState(std::string(op) +
                       ": needs state_snapshots and a request that holds a state slot");
  }
  return config_.num_state_slots + config_.num_state_checkpoints + request.state_slot;
}

void KVCacheManager::snapshot_state(RequestHandle handle) {
  const Request& request = find(handle);
  pending_state_loads_.emplace_back(request.state_slot, snapshot_slot(request, "snapshot_state"));
}

void KVCacheManager::restore_state(RequestHandle handle) {
  const Request& request = find(handle);
  pending_state_loads_.emplace_back(snapshot_slot(request, "restore_state"), request.state_slot);
}

std::vector<std::pair<int, int>> KVCacheManager::take_pending_state_loads() {
  return std::exchange(pending_state_loads_, {});
}

bool KVCacheManager::reset_prefix_cache() {
  // (the host tier first: it can refuse, and then nothing may have changed)
  if (host_ && (host_->num_free_blocks() < host_->num_blocks() ||
                pool_.num_free_blocks() < pool_.num_blocks())) {
    return false;
  }
  if (!pool_.reset_prefix_cache() || (host_ && !host_->reset_prefix_cache())) return false;
  checkpoint_of_.clear();
  unpublished_checkpoints_.clear();
  std::ranges::fill(checkpoint_block_, kNoBlock);
  return true;
}

std::span<const BlockId> KVCacheManager::block_table(const RequestId& id, int group) const {
  check_argument(group >= 0 && group < num_groups(), "block_table: no such KV-cache group");
  return find(id).groups[static_cast<size_t>(group)].blocks;
}

std::span<const BlockId> KVCacheManager::block_table(RequestHandle handle, int group) const {
  check_argument(group >= 0 && group < num_groups(), "block_table: no such KV-cache group");
  return find(handle).groups[static_cast<size_t>(group)].blocks;
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
