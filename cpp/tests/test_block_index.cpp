#include <random>
#include <unordered_map>

#include "harness.h"
#include "pyengine/block_index.h"
#include "pyengine/errors.h"

using namespace pyengine;

namespace {

uint64_t low_bits(uint64_t hi) { return hi % 2 == 0 ? (hi * 7) % 5 : ~0ull - hi % 3; }

}  // namespace

TEST(matches_a_node_map_under_random_insert_and_erase) {
  // Low bits drawn from a few values at both ends of the table: long probe runs, some of
  // which wrap around.
  std::mt19937_64 rng(42);
  for (int round = 0; round < 20; ++round) {
    const int max_entries = 1 + static_cast<int>(rng() % 40);
    BlockIndex index(max_entries);
    std::unordered_map<uint64_t, BlockId> reference;  // key.hi -> block
    bool agrees = true;
    for (int op = 0; op < 5000; ++op) {
      const uint64_t hi = rng() % 64;
      const BlockKey canonical{hi, low_bits(hi)};  // one key per hi
      if (rng() % 2 == 0 && static_cast<int>(reference.size()) < max_entries) {
        const auto block = static_cast<BlockId>(rng() % 1000);
        const bool inserted = index.insert(canonical, block);
        agrees = agrees && inserted == (reference.count(hi) == 0);
        if (inserted) reference[hi] = block;
      } else {
        agrees = agrees && index.erase(canonical) == (reference.erase(hi) == 1);
      }
      agrees = agrees && index.size() == static_cast<int>(reference.size());
      for (uint64_t probe = 0; probe < 64; ++probe) {
        const auto found = index.find(BlockKey{probe, low_bits(probe)});
        const auto it = reference.find(probe);
        agrees = agrees && found.has_value() == (it != reference.end()) &&
                 (!found || *found == it->second);
      }
    }
    CHECK(agrees);
  }
}

TEST(refuses_more_entries_than_blocks) {
  BlockIndex index(2);
  CHECK(index.insert({1, 1}, 0));
  CHECK(index.insert({2, 2}, 1));
  CHECK(!index.insert({2, 2}, 5));
  CHECK_THROWS(InvalidState, index.insert({3, 3}, 2));
  CHECK_THROWS(InvalidArgument, BlockIndex(0));
}

TEST_MAIN()
