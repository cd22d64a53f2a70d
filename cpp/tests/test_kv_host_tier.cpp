#include <algorithm>
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

KVCacheManager with_host_tier(int num_blocks, int num_host_blocks) {
  return KVCacheManager(KVCacheConfig{num_blocks, 4, true, num_host_blocks});
}

}  // namespace

TEST(an_evicted_prefix_is_offloaded_and_hit_in_the_host_tier) {
  auto kv = with_host_tier(4, 8);
  start(kv, "a", iota_tokens(13));  // 3 cached blocks and a partial one
  const std::vector<BlockId> a_blocks(kv.block_table("a").begin(), kv.block_table("a").end());
  kv.free("a");
  CHECK(kv.take_pending_transfers().to_host.empty());
  start(kv, "b", iota_tokens(13, 100));  // evicts a's three cached blocks
  const KVTransfers out = kv.take_pending_transfers();
  CHECK_EQ(out.to_host.size(), 3u);
  CHECK(out.to_device.empty());
  for (const auto& [device, host] : out.to_host) {
    CHECK(std::find(a_blocks.begin(), a_blocks.end() - 1, device) != a_blocks.end() - 1);
    CHECK(kv.host_pool()->is_cached(host));
    CHECK_EQ(kv.host_pool()->ref_count(host), 0);  // released once taken
  }
  kv.free("b");
  const ComputedBlocks hit = start(kv, "c", iota_tokens(13));
  CHECK(hit.groups[0].block_ids.empty());
  CHECK_EQ(hit.groups[0].host_block_ids.size(), 3u);
  CHECK_EQ(hit.num_computed_tokens, 12);
  CHECK_EQ(hit.num_host_tokens, 12);
  const KVTransfers in = kv.take_pending_transfers();
  CHECK_EQ(in.to_device.size(), 3u);
  const auto c = kv.block_table("c");
  for (size_t i = 0; i < 3; ++i) {
    CHECK_EQ(in.to_device[i].first, hit.groups[0].host_block_ids[i]);
    CHECK_EQ(in.to_device[i].second, c[i]);
    CHECK(kv.pool().is_cached(c[i]));  // under the host copy's entry
    CHECK(kv.pool().link(c[i]) == kv.host_pool()->link(hit.groups[0].host_block_ids[i]));
  }
  // Bringing c's blocks in evicted b's cached ones: offloaded in the same transfers,
  // and run before the copies in.
  CHECK_EQ(in.to_host.size(), 3u);
  const KVCacheStats s = kv.stats();
  CHECK_EQ(s.host_cache_hits, 12);
  CHECK_EQ(s.prefix_cache_hits, 12);
  CHECK_EQ(s.num_blocks_offloaded, 6);
  CHECK_EQ(s.num_host_used_blocks, 0);
}

TEST(a_hit_continues_from_the_device_into_the_host_tier) {
  auto kv = with_host_tier(5, 8);
  start(kv, "a", iota_tokens(13));
  kv.free("a");                         // cached (evicted first to last): blocks 2, 1, 0
  start(kv, "x", iota_tokens(9, 100));  // two uncached free blocks and one eviction
  kv.free("x");
  CHECK_EQ(kv.take_pending_transfers().to_host.size(), 1u);
  const ComputedBlocks hit = start(kv, "c", iota_tokens(13));
  CHECK_EQ(hit.groups[0].block_ids.size(), 2u);
  CHECK_EQ(hit.groups[0].host_block_ids.size(), 1u);
  CHECK_EQ(hit.num_computed_tokens, 12);
  CHECK_EQ(hit.num_host_tokens, 4);
}

TEST(host_hits_are_verified_as_device_hits) {
  auto kv = with_host_tier(4, 8);
  start(kv, "a", iota_tokens(13), {0, "alice"});
  kv.free("a");
  start(kv, "b", iota_tokens(13, 100));
  kv.free("b");
  kv.take_pending_transfers();
  // Another tenant's identical prompt finds nothing; the same tenant finds all of it.
  CHECK_EQ(start(kv, "c", iota_tokens(13), {0, "bob"}).num_computed_tokens, 0);
  kv.free("c");
  kv.take_pending_transfers();
  CHECK_EQ(start(kv, "d", iota_tokens(13), {0, "alice"}).num_computed_tokens, 12);
}

TEST(offloading_keeps_one_copy_of_an_entry) {
  auto kv = with_host_tier(4, 8);
  start(kv, "a", iota_tokens(9));
  kv.free("a");
  start(kv, "b", iota_tokens(13, 100));  // offloads a's two blocks
  kv.free("b");
  kv.take_pending_transfers();
  start(kv, "c", iota_tokens(9));  // brings them back, same entries
  kv.free("c");
  kv.take_pending_transfers();
  const KVCacheStats before = kv.stats();
  start(kv, "d", iota_tokens(13, 200));  // evicts c's blocks too: the host has them already
  const KVCacheStats after = kv.stats();
  const int64_t evicted = after.num_evictions - before.num_evictions;
  CHECK_EQ(evicted, 3);
  CHECK_EQ(after.num_blocks_offloaded - before.num_blocks_offloaded, evicted - 2);
  CHECK_EQ(kv.take_pending_transfers().to_host.size(), static_cast<size_t>(evicted - 2));
}

TEST(a_swapped_out_request_comes_back_with_its_computed_tokens) {
  auto kv = with_host_tier(8, 4);
  start(kv, "a", iota_tokens(10));
  const std::vector<BlockId> before(kv.block_table("a").begin(), kv.block_table("a").end());
  kv.take_pending_transfers();
  CHECK(kv.can_swap_out("a"));
  kv.swap_out("a");
  CHECK(kv.is_swapped("a"));
  CHECK(kv.block_table("a").empty());
  CHECK_EQ(kv.num_computed_tokens("a"), 10);
  CHECK_EQ(kv.stats().num_swapped_requests, 1);
  CHECK_EQ(kv.stats().num_host_used_blocks, 3);
  CHECK_THROWS(InvalidState, kv.get_computed_blocks("a"));
  CHECK_THROWS(InvalidState, kv.swap_out("a"));
  CHECK_THROWS(InvalidState, kv.fork("a", "a2"));
  CHECK_THROWS(InvalidState, kv.rollback("a", 4));
  const KVTransfers out = kv.take_pending_transfers();
  CHECK_EQ(out.to_host.size(), 3u);
  for (size_t i = 0; i < 3; ++i) CHECK_EQ(out.to_host[i].first, before[i]);
  kv.append_token_ids("a", std::vector<TokenId>{77, 78, 79});
  CHECK(kv.allocate_slots("a", 3).has_value());  // 13 tokens: four blocks
  const KVTransfers in = kv.take_pending_transfers();
  CHECK_EQ(in.to_device.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    CHECK_EQ(in.to_device[i].first, out.to_host[i].second);
    CHECK_EQ(in.to_device[i].second, kv.block_table("a")[i]);
  }
  CHECK_EQ(kv.block_table("a").size(), 4u);
  CHECK(!kv.is_swapped("a"));
  CHECK_EQ(kv.num_computed_tokens("a"), 13);
  const KVCacheStats s = kv.stats();
  CHECK_EQ(s.num_swapped_requests, 0);
  CHECK_EQ(s.num_host_used_blocks, 0);
  CHECK_EQ(s.num_blocks_swapped_out, 3);
  CHECK_EQ(s.internal_waste_tokens, 3);
}

TEST(swapping_out_needs_room_in_the_host_tier) {
  auto kv = with_host_tier(8, 2);
  start(kv, "a", iota_tokens(10));  // three blocks
  CHECK(!kv.can_swap_out("a"));
  CHECK_THROWS(InvalidState, kv.swap_out("a"));
  auto none = KVCacheManager(KVCacheConfig{8, 4, true});
  start(none, "a", iota_tokens(10));
  CHECK(!none.can_swap_out("a"));
  CHECK_THROWS(InvalidArgument, KVCacheManager(KVCacheConfig{8, 4, true, -1}));
}

TEST(freeing_a_swapped_out_request_releases_its_host_blocks) {
  auto kv = with_host_tier(8, 4);
  start(kv, "a", iota_tokens(10));
  kv.swap_out("a");
  kv.free("a");
  kv.take_pending_transfers();
  const KVCacheStats s = kv.stats();
  CHECK_EQ(s.num_host_used_blocks, 0);
  CHECK_EQ(s.num_swapped_requests, 0);
  CHECK_EQ(s.num_used_blocks, 0);
  CHECK(kv.reset_prefix_cache());
}

TEST(a_pending_copy_holds_its_host_block) {
  auto kv = with_host_tier(4, 1);
  start(kv, "a", iota_tokens(5));  // one cached block
  kv.free("a");
  start(kv, "b", iota_tokens(13, 100));  // offloads it into the only host block
  CHECK_EQ(kv.stats().num_host_used_blocks, 1);  // until the copy is taken
  CHECK(!kv.reset_prefix_cache());
  kv.take_pending_transfers();
  CHECK_EQ(kv.stats().num_host_used_blocks, 0);
  CHECK_EQ(kv.stats().num_host_cached_blocks, 1);
}

TEST_MAIN()
