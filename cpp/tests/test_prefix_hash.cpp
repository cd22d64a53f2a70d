#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "harness.h"
#include "pyengine/errors.h"
#include "pyengine/prefix_hash.h"

using namespace pyengine;

namespace {

std::vector<TokenId> random_tokens(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<TokenId> dist(0, 50000);
  std::vector<TokenId> tokens(n);
  for (auto& t : tokens) t = dist(rng);
  return tokens;
}

std::vector<BlockKey> keys_of(const std::vector<TokenId>& tokens, int block_size, uint64_t extras) {
  std::vector<BlockKey> keys(tokens.size() / static_cast<size_t>(block_size));
  hash_blocks(tokens, block_size, extras, kRootBlockKey, keys);
  return keys;
}

}  // namespace

TEST(xxhash64_matches_published_test_vectors) {
  CHECK_EQ(xxhash64("", 0, 0), 0xEF46DB3751D8E999ull);
  CHECK_EQ(xxhash64("a", 1, 0), 0xD24EC4F1A98C6E5Bull);
  CHECK_EQ(xxhash64("abc", 3, 0), 0x44BC2CF5AD770999ull);
}

TEST(parallel_hash_equals_sequential_chain) {
  const auto tokens = random_tokens(16 * 9000 + 5, 1);  // over 8192 blocks: the OpenMP path
  const auto keys = keys_of(tokens, 16, 7);
  CHECK_EQ(keys.size(), 9000u);
  BlockKey parent = kRootBlockKey;
  bool all_equal = true;
  for (size_t i = 0; i < keys.size(); ++i) {
    parent = hash_block(parent, std::span<const TokenId>(tokens).subspan(i * 16, 16), 7);
    all_equal = all_equal && parent == keys[i];
  }
  CHECK(all_equal);
}

TEST(keys_depend_on_the_whole_prefix) {
  auto a = random_tokens(64, 2);
  auto b = a;
  b[3] += 1;  // differs in block 0 only
  const auto ka = keys_of(a, 16, 0);
  const auto kb = keys_of(b, 16, 0);
  for (size_t i = 0; i < ka.size(); ++i) CHECK(!(ka[i] == kb[i]));
  // A prefix of the tokens gives a prefix of the keys.
  const std::vector<TokenId> head(a.begin(), a.begin() + 40);
  const auto kh = keys_of(head, 16, 0);
  CHECK_EQ(kh.size(), 2u);
  CHECK(kh[0] == ka[0] && kh[1] == ka[1]);
}

TEST(extra_keys_separate_equal_tokens) {
  const auto tokens = random_tokens(32, 3);
  const uint64_t plain = hash_extras({});
  const uint64_t salted = hash_extras({0, "tenant-a"});
  const uint64_t other_salt = hash_extras({0, "tenant-b"});
  const uint64_t adapter = hash_extras({5, ""});
  CHECK(plain != salted && salted != other_salt && plain != adapter);
  CHECK(!(keys_of(tokens, 16, plain)[0] == keys_of(tokens, 16, salted)[0]));
  CHECK(keys_of(tokens, 16, salted)[1] == keys_of(tokens, 16, hash_extras({0, "tenant-a"}))[1]);
}

TEST(hash_blocks_checks_its_arguments) {
  const auto tokens = random_tokens(32, 4);
  std::vector<BlockKey> wrong_size(3);
  CHECK_THROWS(InvalidArgument, hash_blocks(tokens, 16, 0, kRootBlockKey, wrong_size));
  std::vector<BlockKey> none;
  CHECK_THROWS(InvalidArgument, hash_blocks(tokens, 0, 0, kRootBlockKey, none));
}

TEST_MAIN()
