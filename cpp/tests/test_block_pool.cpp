#include <vector>

#include "harness.h"
#include "pyengine/block_pool.h"
#include "pyengine/errors.h"

using namespace pyengine;

namespace {

std::vector<TokenId> block_of(TokenId first) { return {first, first + 1, first + 2, first + 3}; }

}  // namespace

TEST(rejects_bad_sizes) {
  CHECK_THROWS(InvalidArgument, BlockPool(0, 16));
  CHECK_THROWS(InvalidArgument, BlockPool(-1, 16));
  CHECK_THROWS(InvalidArgument, BlockPool(8, 0));
  CHECK_THROWS(InvalidArgument, BlockPool(8, 12));
  CHECK_THROWS(InvalidArgument, BlockPool(8, -16));
}

TEST(allocates_until_empty_then_refuses) {
  BlockPool pool(3, 4);
  CHECK(pool.can_allocate(3));
  CHECK(!pool.can_allocate(4));
  const BlockId a = pool.allocate();
  pool.allocate();
  pool.allocate();
  CHECK_EQ(pool.num_free_blocks(), 0);
  CHECK_THROWS(InvalidState, pool.allocate());
  pool.release(a);
  CHECK_EQ(pool.num_free_blocks(), 1);
  CHECK_THROWS(InvalidState, pool.release(a));  // released twice
  CHECK_THROWS(InvalidArgument, pool.release(7));
}

TEST(uncached_blocks_go_first_then_cached_in_lru_order) {
  BlockPool pool(4, 4);
  std::vector<BlockId> b;
  for (int i = 0; i < 4; ++i) b.push_back(pool.allocate());
  CHECK(pool.cache(b[0], {1, 1}, block_of(0), {}, {}));
  CHECK(pool.cache(b[1], {2, 2}, block_of(4), pool.link(b[0]), {}));
  pool.release(b[1]);  // cached, freed first: least recently used
  pool.release(b[2]);  // uncached
  pool.release(b[0]);  // cached, freed last
  const auto order = pool.free_blocks_in_order();
  CHECK((order == std::vector<BlockId>{b[2], b[1], b[0]}));
  CHECK_EQ(pool.allocate(), b[2]);
  CHECK_EQ(pool.num_evictions(), 0);
  CHECK_EQ(pool.allocate(), b[1]);  // evicts the LRU cached block
  CHECK_EQ(pool.num_evictions(), 1);
  CHECK(!pool.lookup({2, 2}).has_value());
  CHECK(pool.lookup({1, 1}).has_value());
}

TEST(uncached_blocks_are_reused_most_recently_freed_first) {
  BlockPool pool(6, 4);
  std::vector<BlockId> b;
  for (int i = 0; i < 4; ++i) b.push_back(pool.allocate());
  CHECK((b == std::vector<BlockId>{0, 1, 2, 3}));  // a fresh pool: in id order
  pool.release(b[1]);
  pool.release(b[3]);
  CHECK((pool.free_blocks_in_order() == std::vector<BlockId>{b[3], b[1], 4, 5}));
  CHECK_EQ(pool.allocate(), b[3]);
  CHECK_EQ(pool.allocate(), b[1]);
  CHECK_EQ(pool.allocate(), 4);
}

TEST(reset_prefix_cache_puts_the_dropped_blocks_first_in_eviction_order) {
  BlockPool pool(4, 4);
  std::vector<BlockId> b;
  for (int i = 0; i < 3; ++i) b.push_back(pool.allocate());
  CHECK(pool.cache(b[0], {1, 1}, block_of(0), {}, {}));
  CHECK(pool.cache(b[1], {2, 2}, block_of(4), pool.link(b[0]), {}));
  pool.release(b[1]);
  pool.release(b[0]);
  pool.release(b[2]);  // uncached
  CHECK((pool.free_blocks_in_order() == std::vector<BlockId>{b[2], 3, b[1], b[0]}));
  CHECK(pool.reset_prefix_cache());
  CHECK_EQ(pool.num_cached_blocks(), 0);
  CHECK((pool.free_blocks_in_order() == std::vector<BlockId>{b[1], b[0], b[2], 3}));
}

TEST(a_prefix_hit_takes_a_block_out_of_the_middle_of_the_free_queue) {
  BlockPool pool(3, 4);
  std::vector<BlockId> b;
  for (int i = 0; i < 3; ++i) b.push_back(pool.allocate());
  for (int i = 0; i < 3; ++i) {
    CHECK(pool.cache(b[i], {static_cast<uint64_t>(i + 1), 0}, block_of(4 * i),
                     i == 0 ? BlockLink{} : pool.link(b[i - 1]), {}));
  }
  for (int i = 0; i < 3; ++i) pool.release(b[i]);
  pool.retain(b[1]);
  CHECK_EQ(pool.ref_count(b[1]), 1);
  CHECK(!pool.is_free(b[1]));
  CHECK((pool.free_blocks_in_order() == std::vector<BlockId>{b[0], b[2]}));
}

TEST(verify_compares_tokens_parent_and_extras) {
  BlockPool pool(4, 4);
  const BlockId root = pool.allocate();
  const BlockId child = pool.allocate();
  const BlockExtras salted{0, "tenant"};
  CHECK(pool.cache(root, {9, 9}, block_of(0), {}, salted));
  CHECK(pool.cache(child, {8, 8}, block_of(4), pool.link(root), salted));
  CHECK(pool.verify(root, block_of(0), {}, salted));
  CHECK(!pool.verify(root, block_of(1), {}, salted));           // other tokens (a collision)
  CHECK(!pool.verify(root, block_of(0), {}, BlockExtras{}));    // other tenant
  CHECK(pool.verify(child, block_of(4), pool.link(root), {}));  // extras checked at the root
  CHECK(!pool.verify(child, block_of(4), {}, salted));          // other parent
  // A key is written once; another block cannot take it.
  const BlockId other = pool.allocate();
  CHECK(!pool.cache(other, {9, 9}, block_of(0), {}, salted));
  CHECK(!pool.is_cached(other));
  CHECK_THROWS(InvalidState, pool.cache(root, {7, 7}, block_of(0), {}, salted));
}

TEST(eviction_invalidates_links_to_the_evicted_incarnation) {
  BlockPool pool(2, 4);
  const BlockId root = pool.allocate();
  const BlockId child = pool.allocate();
  CHECK(pool.cache(root, {1, 0}, block_of(0), {}, {}));
  const BlockLink old_link = pool.link(root);
  CHECK(pool.cache(child, {2, 0}, block_of(4), old_link, {}));
  pool.release(root);
  pool.release(child);
  const BlockId reused = pool.allocate();  // evicts root (freed first)
  CHECK_EQ(reused, root);
  CHECK(!(pool.link(root) == old_link));
  CHECK(!pool.verify(child, block_of(4), pool.link(root), {}));
}

TEST(reset_prefix_cache_needs_an_idle_pool) {
  BlockPool pool(2, 4);
  const BlockId b = pool.allocate();
  CHECK(pool.cache(b, {1, 0}, block_of(0), {}, {}));
  CHECK(!pool.reset_prefix_cache());
  CHECK_EQ(pool.num_cached_blocks(), 1);
  pool.release(b);
  CHECK(pool.reset_prefix_cache());
  CHECK_EQ(pool.num_cached_blocks(), 0);
  CHECK(!pool.lookup({1, 0}).has_value());
  CHECK_EQ(pool.num_free_blocks(), 2);
}

TEST_MAIN()
