// KVCacheManager's host tier: offload on eviction, hits copied back in, swapping out.
#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "pyengine/errors.h"
#include "pyengine/kv_cache_manager.h"

namespace pyengine {

BlockId KVCacheManager::take_block() {
  if (host_) {
    if (const auto evicted = pool_.next_eviction()) offload(*evicted);
  }
  const BlockId block = pool_.allocate();
  drop_checkpoint(block);  // (evicted: its prefix's state goes with its KV)
  return block;
}

void KVCacheManager::offload(BlockId block) {
  const BlockKey key = pool_.key(block);
  const BlockLink entry = pool_.link(block);
  if (const auto held = host_->lookup(key)) {
    if (host_->ref_count(*held) > 0) return;  // a copy this step makes or reads
    host_->retain(*held);
    if (host_->link(*held) == entry) {  // already there: it becomes the newest
      host_->release(*held);
      return;
    }
    // An older entry of the same content: the newer one replaces it (its children on
    // the device link to the newer).
    host_->uncache(*held);
    host_->release(*held);
  }
  if (host_->num_free_blocks() == 0) return;  // every host block is held: dropped
  const BlockId copy = host_->allocate();
  host_->cache(copy, key, pool_.stored_tokens(block), pool_.parent(block),
               pool_.first_block_extras(block), entry);
  pending_transfers_.to_host.emplace_back(block, copy);
  held_host_blocks_.push_back(copy);
  ++num_blocks_offloaded_;
}

BlockId KVCacheManager::copy_in_hit(Request& request, int group, size_t block_index,
                                    BlockId host_block, const BlockLink& parent) {
  const BlockId block = take_block();
  pool_.set_num_filled(block, block_size());
  // plan() checked that no device block holds the key.
  if (!pool_.cache(block, group_key(request, group, block_index), block_tokens(request, block_index),
                   parent, request.groups[static_cast<size_t>(group)].extras,
                   host_->link(host_block))) {
    throw InvalidState("copy_in_hit: a device block caches the key already");
  }
  pending_transfers_.to_device.emplace_back(host_block, block);
  held_host_blocks_.push_back(host_block);  // retained by the caller
  return block;
}

std::optional<BlockId> KVCacheManager::content_at_step_start(BlockId block) const {
  // Device-to-host copies run first in a step, so a block this step fills by a copy is
  // read from the copy's source, and one it fills from the host tier cannot be read.
  for (const auto& [source, destination] : pending_copies_) {
    if (destination == block) return content_at_step_start(source);
  }
  for (const auto& [host_block, destination] : pending_transfers_.to_device) {
    if (destination == block) return std::nullopt;
  }
  return block;
}

bool KVCacheManager::can_swap_out(const RequestId& id) const {
  const Request& request = find(id);
  // (a recurrent state stays in its slot, which the request keeps while swapped out: a
  // fixed few bytes beside its blocks, and no copy to make)
  if (!host_ || request.swapped) return false;
  size_t num_held = 0;
  for (const GroupTable& table : request.groups) {
    for (const BlockId b : table.blocks) {
      if (b == kNoBlock) continue;
      if (!content_at_step_start(b)) return false;
      ++num_held;
    }
  }
  return num_held > 0 && static_cast<size_t>(host_->num_free_blocks()) >= num_held;
}

void KVCacheManager::swap_out(const RequestId& id) {
  if (!can_swap_out(id)) {
    throw InvalidState("swap_out: request '" + id +
                       "' has no blocks, is swapped out, or the host tier has too few free "
                       "blocks");
  }
  Request& request = find(id);
  for (GroupTable& table : request.groups) {
    for (const BlockId block : table.blocks) {
      if (block == kNoBlock) {
        table.host.push_back(kNoBlock);
        continue;
      }
      const BlockId copy = host_->allocate();
      pending_transfers_.to_host.emplace_back(*content_at_step_start(block), copy);
      table.host.push_back(copy);
      ++num_blocks_swapped_out_;
    }
  }
  // Its copy-on-write copies are no longer needed: the host copies read their sources.
  std::erase_if(pending_copies_, [&request](const auto& copy) {
    return std::ranges::any_of(request.groups, [&copy](const GroupTable& table) {
      return std::ranges::find(table.blocks, copy.second) != table.blocks.end();
    });
  });
  ++num_swapped_requests_;
  request.swapped = true;
  for (GroupTable& table : request.groups) {
    // (released last block first, as free() does; cached ones stay cached)
    for (auto b = table.blocks.rbegin(); b != table.blocks.rend(); ++b) {
      if (*b != kNoBlock) pool_.release(*b);
    }
    table.blocks.clear();
    table.num_released = table.num_cached = 0;
    table.cached_tail = {};
    table.caching_stopped = false;
  }
}

void KVCacheManager::swap_in(Request& request, const Plan& p) {
  // A swapped-out request's blocks come back (its host blocks, held, are released once
  // the copies are taken), but for those a window no longer needs.
  const int size = block_size();
  for (size_t g = 0; g < request.groups.size(); ++g) {
    GroupTable& table = request.groups[g];
    const auto first_needed = static_cast<size_t>(p.groups[g].first_needed);
    for (size_t i = 0; i < table.host.size(); ++i) {
      const BlockId host_block = table.host[i];
      if (host_block == kNoBlock || i < first_needed) {
        if (host_block != kNoBlock) host_->release(host_block);
        table.blocks.push_back(kNoBlock);
        continue;
      }
      const BlockId block = take_block();
      pool_.set_num_filled(block, std::clamp(request.num_computed_tokens -
                                                 static_cast<int>(i) * size, 0, size));
      pending_transfers_.to_device.emplace_back(host_block, block);
      held_host_blocks_.push_back(host_block);
      table.blocks.push_back(block);
    }
    table.num_released = static_cast<int>(std::min(first_needed, table.host.size()));
    table.host.clear();
  }
  --num_swapped_requests_;
  request.swapped = false;
}

KVTransfers KVCacheManager::take_pending_transfers() {
  for (const BlockId h : held_host_blocks_) host_->release(h);
  held_host_blocks_.clear();
  return std::exchange(pending_transfers_, {});
}

}  // namespace pyengine
