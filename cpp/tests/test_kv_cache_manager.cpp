#include <numeric>
#include <vector>

#include "harness.h"
#include "kv_testing.h"
#include "pyengine/errors.h"
#include "pyengine/kv_cache_manager.h"

using namespace pyengine;
using pyengine::testing::iota_tokens;
using pyengine::testing::start;

namespace {

KVCacheManager make(int num_blocks, int block_size = 4) {
  return KVCacheManager(KVCacheConfig{num_blocks, block_size, true});
}

}  // namespace

TEST(a_second_request_reuses_the_cached_prefix) {
  auto kv = make(16);
  start(kv, "a", iota_tokens(10));
  const auto hit = start(kv, "b", iota_tokens(10));
  CHECK_EQ(hit.num_computed_tokens, 8);
  const auto a = kv.block_table("a");
  const auto b = kv.block_table("b");
  CHECK(a[0] == b[0] && a[1] == b[1] && a[2] != b[2]);
  CHECK_EQ(kv.pool().ref_count(a[0]), 2);
  const KVCacheStats s = kv.stats();
  CHECK_EQ(s.prefix_cache_queries, 20);
  CHECK_EQ(s.prefix_cache_hits, 8);
}

TEST(a_hit_never_covers_the_whole_prompt) {
  auto kv = make(16);
  start(kv, "a", iota_tokens(12));
  const auto hit = start(kv, "b", iota_tokens(12));
  CHECK_EQ(hit.num_computed_tokens, 8);  // the last block is computed again
}

TEST(cache_salt_isolates_tenants) {
  auto kv = make(16);
  start(kv, "a", iota_tokens(12), {0, "alice"});
  CHECK_EQ(start(kv, "b", iota_tokens(12), {0, "bob"}).num_computed_tokens, 0);
  CHECK_EQ(start(kv, "c", iota_tokens(12), {0, "alice"}).num_computed_tokens, 8);
  CHECK_EQ(start(kv, "d", iota_tokens(12), {3, "alice"}).num_computed_tokens, 0);  // adapter
}

TEST(freed_blocks_stay_cached_until_evicted) {
  auto kv = make(4);
  start(kv, "a", iota_tokens(12));
  kv.free("a");
  CHECK_EQ(kv.num_free_blocks(), 4);
  CHECK_EQ(start(kv, "b", iota_tokens(12)).num_computed_tokens, 8);
  kv.free("b");
  start(kv, "c", iota_tokens(16, 1000));  // needs all 4 blocks: evicts every cached one
  CHECK(kv.stats().num_evictions >= 2);
  kv.add_request("d", iota_tokens(12));
  CHECK_EQ(kv.get_computed_blocks("d").num_computed_tokens, 0);
}

TEST(a_failed_allocation_changes_nothing) {
  auto kv = make(4);
  start(kv, "a", iota_tokens(8));
  kv.add_request("b", iota_tokens(20, 100));
  const KVCacheStats before = kv.stats();
  CHECK(!kv.can_allocate_slots("b", 20));
  CHECK(!kv.allocate_slots("b", 20).has_value());
  const KVCacheStats after = kv.stats();
  CHECK_EQ(after.num_free_blocks, before.num_free_blocks);
  CHECK_EQ(after.num_cached_blocks, before.num_cached_blocks);
  CHECK(kv.block_table("b").empty());
  CHECK_EQ(kv.num_computed_tokens("b"), 0);
}

TEST(decode_appends_and_caches_blocks_as_they_fill) {
  auto kv = make(8);
  start(kv, "a", iota_tokens(6));
  CHECK_EQ(kv.stats().num_cached_blocks, 1);
  for (TokenId t = 6; t < 9; ++t) {
    const TokenId sampled[] = {t};
    kv.append_token_ids("a", sampled);
    CHECK(kv.allocate_slots("a", 1).has_value());
  }
  CHECK_EQ(kv.num_computed_tokens("a"), 9);
  CHECK_EQ(kv.block_table("a").size(), 3u);
  CHECK_EQ(kv.stats().num_cached_blocks, 2);
  CHECK_EQ(kv.stats().internal_waste_tokens, 3);
  // Tokens not yet known cannot be scheduled.
  CHECK_THROWS(InvalidArgument, kv.allocate_slots("a", 1));
}

TEST(lookahead_slots_are_allocated_but_not_computed) {
  auto kv = make(8);
  kv.add_request("a", iota_tokens(4));
  const auto blocks = kv.allocate_slots("a", 4, 5);
  CHECK(blocks.has_value() && blocks->size() == 3u);
  CHECK_EQ(kv.num_computed_tokens("a"), 4);
  CHECK_EQ(kv.stats().internal_waste_tokens, 8);
}

TEST(fork_shares_blocks_and_copies_the_partial_block_on_write) {
  auto kv = make(8);
  start(kv, "parent", iota_tokens(6));
  kv.fork("parent", "child");
  const std::vector<BlockId> shared(kv.block_table("parent").begin(),
                                    kv.block_table("parent").end());
  CHECK((std::vector<BlockId>(kv.block_table("child").begin(), kv.block_table("child").end()) ==
         shared));
  CHECK_EQ(kv.pool().ref_count(shared[1]), 2);

  const TokenId parent_token[] = {100};
  kv.append_token_ids("parent", parent_token);
  CHECK(kv.allocate_slots("parent", 1).has_value());
  const auto copies = kv.take_pending_copies();
  CHECK_EQ(copies.size(), 1u);
  CHECK_EQ(copies[0].first, shared[1]);
  CHECK(kv.block_table("parent")[1] == copies[0].second);
  CHECK(kv.block_table("parent")[0] == shared[0]);  // full blocks stay shared
  CHECK_EQ(kv.pool().ref_count(shared[1]), 1);

  const TokenId child_token[] = {200};
  kv.append_token_ids("child", child_token);
  CHECK(kv.allocate_slots("child", 1).has_value());
  CHECK(kv.take_pending_copies().empty());  // the child is now the only holder
  CHECK(kv.block_table("child")[1] == shared[1]);
  kv.free("parent");
  kv.free("child");
  CHECK_EQ(kv.num_free_blocks(), 8);
}

TEST(bad_input_is_rejected_and_changes_nothing) {
  auto kv = make(8);
  CHECK_THROWS(InvalidArgument, KVCacheManager(KVCacheConfig{8, 6, true}));
  CHECK_THROWS(InvalidArgument, KVCacheManager(KVCacheConfig{0, 16, true}));
  CHECK_THROWS(InvalidArgument, KVCacheManager(KVCacheConfig{}));  // no defaults to fall back on
  CHECK_THROWS(InvalidArgument, kv.add_request("a", std::vector<TokenId>{}));
  CHECK_THROWS(InvalidArgument, kv.add_request("a", std::vector<TokenId>{1, -2}));
  CHECK(!kv.has_request("a"));
  start(kv, "a", iota_tokens(5));
  CHECK_THROWS(InvalidArgument, kv.add_request("a", iota_tokens(3)));
  CHECK_THROWS(UnknownRequest, kv.allocate_slots("nobody", 1));
  CHECK_THROWS(InvalidArgument, kv.allocate_slots("a", 0));
  CHECK_THROWS(InvalidArgument, kv.allocate_slots("a", -3));
  CHECK_THROWS(InvalidArgument, kv.allocate_slots("a", 1, -1));
  CHECK_THROWS(InvalidState, kv.get_computed_blocks("a"));
  CHECK_THROWS(InvalidArgument, kv.fork("a", "a"));
  CHECK_THROWS(UnknownRequest, kv.fork("nobody", "b"));
  kv.free("a");
  CHECK_THROWS(UnknownRequest, kv.free("a"));
  CHECK_EQ(kv.num_free_blocks(), 8);
}

TEST(stale_computed_blocks_are_rejected) {
  auto kv = make(3);
  start(kv, "a", iota_tokens(9));
  kv.free("a");
  kv.add_request("b", iota_tokens(9));
  ComputedBlocks hit = kv.get_computed_blocks("b");
  CHECK_EQ(hit.num_computed_tokens, 8);
  start(kv, "c", iota_tokens(12, 500));  // evicts the blocks of the hit
  kv.free("c");
  CHECK_THROWS(InvalidArgument, kv.allocate_slots("b", 1, 0, &hit));
  CHECK(kv.block_table("b").empty());
}

TEST(rollback_takes_back_scheduled_tokens_and_their_cache_entries) {
  auto kv = make(8);
  kv.add_request("a", iota_tokens(10));
  CHECK(kv.allocate_slots("a", 10).has_value());
  CHECK_EQ(kv.stats().num_cached_blocks, 2);
  kv.rollback("a", 5);  // the step that computed tokens 5..9 was cancelled
  CHECK_EQ(kv.num_computed_tokens("a"), 5);
  CHECK_EQ(kv.stats().num_cached_blocks, 1);  // block 1 (tokens 4..7) was never computed
  CHECK_EQ(kv.block_table("a").size(), 3u);   // blocks stay allocated
  CHECK_THROWS(InvalidArgument, kv.rollback("a", 6));
  CHECK_THROWS(InvalidArgument, kv.rollback("a", -1));
  CHECK_THROWS(UnknownRequest, kv.rollback("b", 0));
  CHECK(kv.allocate_slots("a", 5).has_value());  // recomputed: cached again
  CHECK_EQ(kv.stats().num_cached_blocks, 2);
  kv.add_request("b", iota_tokens(10));
  CHECK_EQ(kv.get_computed_blocks("b").num_computed_tokens, 8);
}

TEST(handles_name_one_request_and_go_stale_when_it_is_freed) {
  auto kv = make(8);
  kv.add_request("a", iota_tokens(6));
  const RequestHandle a = kv.handle("a");
  CHECK(kv.allocate_slots(a, 6).has_value());
  CHECK((std::vector<BlockId>(kv.block_table(a).begin(), kv.block_table(a).end()) ==
         std::vector<BlockId>(kv.block_table("a").begin(), kv.block_table("a").end())));
  kv.free("a");
  CHECK_THROWS(InvalidArgument, kv.block_table(a));
  kv.add_request("b", iota_tokens(3));  // reuses a's slot
  CHECK_EQ(kv.handle("b").slot, a.slot);
  CHECK_THROWS(InvalidArgument, kv.allocate_slots(a, 1));
  kv.fork("b", "c");
  CHECK_THROWS(InvalidArgument, kv.append_token_ids(a, iota_tokens(1)));
  CHECK_THROWS(UnknownRequest, kv.handle("a"));
}

TEST(reset_prefix_cache_only_when_idle) {
  auto kv = make(8);
  start(kv, "a", iota_tokens(8));
  CHECK(!kv.reset_prefix_cache());
  kv.free("a");
  CHECK(kv.reset_prefix_cache());
  CHECK_EQ(start(kv, "b", iota_tokens(8)).num_computed_tokens, 0);
}

// Recurrent-state slots (KVCacheConfig::num_state_slots): one a request, from its first
// allocation to its release; admission waits for a free one as for blocks.
TEST(state_slots_are_taken_at_first_allocation_and_released_when_freed) {
  KVCacheConfig config{16, 4, false};
  config.num_state_slots = 2;
  KVCacheManager kv(config);
  kv.add_request("a", iota_tokens(5));
  CHECK_EQ(kv.state_slot("a"), -1);  // (none before its first allocation)
  CHECK(kv.allocate_slots("a", 5).has_value());
  CHECK_EQ(kv.state_slot("a"), 0);
  kv.add_request("b", iota_tokens(3, 100));
  CHECK(kv.allocate_slots("b", 3).has_value());
  CHECK_EQ(kv.state_slot("b"), 1);
  CHECK_EQ(kv.num_free_state_slots(), 0);
  // A third request has blocks enough but no slot: nothing changes.
  kv.add_request("c", iota_tokens(3, 200));
  const int free_blocks = kv.num_free_blocks();
  CHECK(!kv.can_allocate_slots("c", 3));
  CHECK(!kv.allocate_slots("c", 3).has_value());
  CHECK_EQ(kv.num_free_blocks(), free_blocks);
  CHECK_EQ(kv.state_slot("c"), -1);
  kv.free("a");  // (as preemption by recompute frees it)
  CHECK_EQ(kv.num_free_state_slots(), 1);
  CHECK(kv.allocate_slots("c", 3).has_value());
  CHECK_EQ(kv.state_slot("c"), 0);
  // Later allocations keep the slot.
  kv.append_token_ids("c", std::vector<TokenId>{7});
  CHECK(kv.allocate_slots("c", 1).has_value());
  CHECK_EQ(kv.state_slot("c"), 0);
}

TEST(a_forks_child_takes_its_own_state_slot_and_a_copy_of_its_parents_state) {
  KVCacheConfig config{16, 4, false};
  config.num_state_slots = 2;
  KVCacheManager kv(config);
  kv.add_request("a", iota_tokens(6));
  CHECK(kv.allocate_slots("a", 6).has_value());
  kv.fork("a", "a1");
  CHECK_EQ(kv.state_slot("a1"), 1);
  const auto copies = kv.take_pending_state_copies();
  CHECK(copies.size() == 1 && copies[0] == std::make_pair(0, 1));
  CHECK(kv.take_pending_state_copies().empty());
  CHECK_THROWS(InvalidState, kv.fork("a", "a2"));  // (no slot left)
  CHECK(!kv.has_request("a2"));
  kv.free("a1");
  CHECK_EQ(kv.num_free_state_slots(), 1);
  // A parent with no slot yet (not allocated) gives its child none either.
  kv.add_request("b", iota_tokens(3, 50));
  kv.fork("b", "b1");
  CHECK_EQ(kv.state_slot("b1"), -1);
  CHECK(kv.take_pending_state_copies().empty());
}

TEST(a_prefix_hit_resumes_a_state_from_the_checkpoint_of_its_last_block) {
  KVCacheConfig config{16, 4, true};
  config.num_state_slots = 2;
  config.num_state_checkpoints = 2;  // (slots 2 and 3)
  KVCacheManager kv(config);
  kv.add_request("a", iota_tokens(11));
  CHECK(kv.allocate_slots("a", 8).has_value());  // a chunk ending at block 1's end
  const auto saves = kv.take_pending_state_copies();
  CHECK(saves.size() == 1 && saves[0] == std::make_pair(0, 2));
  CHECK_EQ(kv.num_state_checkpoints_held(), 1);
  CHECK(kv.allocate_slots("a", 3).has_value());  // (no boundary: no checkpoint)
  CHECK(kv.take_pending_state_copies().empty());
  // A prompt that shares 10 tokens: block 1 is its hit's last with a checkpoint.
  auto prompt = iota_tokens(10);
  prompt.push_back(99);
  kv.add_request("b", prompt);
  const ComputedBlocks hit = kv.get_computed_blocks("b");
  CHECK_EQ(hit.num_computed_tokens, 8);
  CHECK_EQ(hit.state_checkpoint, 2);
  CHECK(kv.allocate_slots("b", 3, 0, &hit).has_value());
  const auto loads = kv.take_pending_state_loads();
  CHECK(loads.size() == 1 && loads[0] == std::make_pair(2, 1));
  // A checkpoint saved in a step is read from the next step on only.
  kv.free("a");
  kv.free("b");
  kv.add_request("d", iota_tokens(9, 40));
  CHECK(kv.allocate_slots("d", 8).has_value());  // checkpoints block 1 of d's prefix
  kv.add_request("e", iota_tokens(9, 40));
  CHECK_EQ(kv.get_computed_blocks("e").num_computed_tokens, 0);  // (its copy has not run)
  kv.take_pending_state_copies();
  CHECK_EQ(kv.get_computed_blocks("e").num_computed_tokens, 8);
}

TEST(a_checkpoint_goes_with_its_blocks_cache_entry) {
  KVCacheConfig config{4, 4, true};
  config.num_state_slots = 1;
  config.num_state_checkpoints = 1;
  KVCacheManager kv(config);
  kv.add_request("a", iota_tokens(9));
  CHECK(kv.allocate_slots("a", 8).has_value());
  kv.take_pending_state_copies();
  CHECK_EQ(kv.num_state_checkpoints_held(), 1);
  kv.rollback("a", 4);  // block 1 leaves the cache, and its checkpoint with it
  CHECK_EQ(kv.num_state_checkpoints_held(), 0);
  CHECK(kv.allocate_slots("a", 4).has_value());
  kv.take_pending_state_copies();
  CHECK_EQ(kv.num_state_checkpoints_held(), 1);
  kv.free("a");
  // Another prompt takes every block: the cached ones are evicted, their checkpoint too.
  kv.add_request("b", iota_tokens(13, 100));
  CHECK(kv.allocate_slots("b", 13).has_value());
  CHECK_EQ(kv.num_state_checkpoints_held(), 0);
  kv.free("b");
  // And the prefix cache reset drops them all.
  kv.add_request("c", iota_tokens(5, 7));
  CHECK(kv.allocate_slots("c", 4).has_value());
  kv.take_pending_state_copies();
  kv.free("c");
  CHECK_EQ(kv.num_state_checkpoints_held(), 1);
  CHECK(kv.reset_prefix_cache());
  CHECK_EQ(kv.num_state_checkpoints_held(), 0);
}

TEST(checkpoints_every_k_blocks_and_at_the_prompts_last_full_block) {
  KVCacheConfig config{32, 4, true};
  config.num_state_slots = 1;
  config.num_state_checkpoints = 4;
  config.state_checkpoint_interval = 3;
  KVCacheManager kv(config);
  kv.add_request("a", iota_tokens(22));  // (its prompt's last full block: block 4)
  // A block boundary each step: checkpoints at blocks 2 (the interval) and 4 (the prompt).
  for (int block = 0; block < 5; ++block) {
    CHECK(kv.allocate_slots("a", 4).has_value());
    const size_t saves = kv.take_pending_state_copies().size();
    CHECK_EQ(saves, static_cast<size_t>(block == 2 || block == 4 ? 1 : 0));
  }
  CHECK(kv.allocate_slots("a", 2).has_value());  // (22: no boundary)
  kv.append_token_ids("a", iota_tokens(6, 500));
  for (int block = 5; block < 7; ++block) {  // decode steps: the interval's block 5 alone
    CHECK(kv.allocate_slots("a", block == 5 ? 2 : 4).has_value());
    CHECK_EQ(kv.take_pending_state_copies().size(), static_cast<size_t>(block == 5 ? 1 : 0));
  }
  CHECK_EQ(kv.num_state_checkpoints_held(), 3);
  // A prompt sharing 19 tokens hits up to block 2's checkpoint (12 tokens), not block 3's
  // end; one sharing the whole prompt, up to block 4 (20).
  auto shares = iota_tokens(19);
  shares.push_back(999);
  kv.add_request("b", shares);
  CHECK_EQ(kv.get_computed_blocks("b").num_computed_tokens, 12);
  kv.add_request("c", iota_tokens(23));
  CHECK_EQ(kv.get_computed_blocks("c").num_computed_tokens, 20);
  config.state_checkpoint_interval = 0;
  CHECK_THROWS(InvalidArgument, KVCacheManager{config});
}

TEST(state_snapshots_save_and_put_back_a_verifying_steps_state) {
  KVCacheConfig config{16, 4, true};
  config.num_state_slots = 2;
  config.num_state_checkpoints = 2;
  config.state_snapshots = true;  // (slot s's snapshot: 4 + s)
  KVCacheManager kv(config);
  kv.add_request("a", iota_tokens(4));
  const RequestHandle a = kv.handle("a");
  CHECK_THROWS(InvalidState, kv.snapshot_state(a));  // (no slot yet)
  CHECK(kv.allocate_slots("a", 4).has_value());
  kv.take_pending_state_copies();  // (block 0's checkpoint)
  kv.append_token_ids("a", iota_tokens(1, 50));
  CHECK(kv.allocate_slots(a, 1, 3).has_value());  // a decode token and 3 drafts' slots
  kv.snapshot_state(a);
  CHECK(kv.take_pending_state_loads() == (std::vector<std::pair<int, int>>{{0, 4}}));
  kv.restore_state(a);
  CHECK(kv.take_pending_state_loads() == (std::vector<std::pair<int, int>>{{4, 0}}));
  // Accepted drafts that end a block become computed tokens with no checkpoint.
  kv.append_token_ids("a", iota_tokens(3, 60));
  CHECK(kv.accept_lookahead(a, 3).has_value());
  CHECK(kv.take_pending_state_copies().empty());
  CHECK_EQ(kv.num_state_checkpoints_held(), 1);
  config.num_state_slots = 0;
  config.num_state_checkpoints = 0;
  config.enable_prefix_caching = false;
  CHECK_THROWS(InvalidArgument, KVCacheManager{config});  // (snapshots without slots)
}

TEST(state_checkpoints_need_slots_prefix_caching_one_group_and_no_host_tier) {
  KVCacheConfig config{16, 4, true};
  config.num_state_slots = 2;
  CHECK_THROWS(InvalidArgument, KVCacheManager{config});  // (no checkpoints)
  config.num_state_checkpoints = 2;
  config.num_host_blocks = 4;
  CHECK_THROWS(InvalidArgument, KVCacheManager{config});
  config.num_host_blocks = 0;
  config.groups = {KVGroupSpec{}, KVGroupSpec{}};
  CHECK_THROWS(InvalidArgument, KVCacheManager{config});
  config.groups = {};
  config.enable_prefix_caching = false;
  CHECK_THROWS(InvalidArgument, KVCacheManager{config});
}

TEST(state_slots_refuse_prefix_caching_and_stay_through_a_swap) {
  KVCacheConfig config{16, 4, true};
  config.num_state_slots = 2;
  CHECK_THROWS(InvalidArgument, KVCacheManager{config});
  config.enable_prefix_caching = false;
  config.num_host_blocks = 8;
  KVCacheManager kv(config);
  kv.add_request("a", iota_tokens(6));
  CHECK(kv.allocate_slots("a", 6).has_value());
  const int slot = kv.state_slot("a");
  CHECK(kv.can_swap_out("a"));
  kv.swap_out("a");  // (its blocks to the host; its state stays in its slot)
  CHECK_EQ(kv.state_slot("a"), slot);
  CHECK_EQ(kv.num_free_state_slots(), 1);
  kv.append_token_ids("a", std::vector<TokenId>{7});
  CHECK(kv.allocate_slots("a", 1).has_value());  // swapped back in
  CHECK(!kv.is_swapped("a"));
  CHECK_EQ(kv.state_slot("a"), slot);
  kv.free("a");
  CHECK_EQ(kv.num_free_state_slots(), 2);
  config.num_state_slots = -1;
  CHECK_THROWS(InvalidArgument, KVCacheManager{config});
}

TEST_MAIN()
