// Prompt lookup: the longest repeated suffix's most recent earlier occurrence, and what
// followed it; through the scheduler, a proposal for each decoding request.
#include <vector>

#include "harness.h"
#include "pyengine/errors.h"
#include "pyengine/ngram_proposer.h"
#include "pyengine/scheduler.h"
#include "scheduler_testing.h"

using namespace pyengine;

namespace {

std::vector<TokenId> propose(const std::vector<TokenId>& tokens, int min_n, int max_n, int k) {
  return propose_ngram(tokens, NgramConfig{min_n, max_n, k});
}

}  // namespace

TEST(the_longest_suffix_seen_before_proposes_what_followed_it) {
  // "5 6" occurred at 1 and at 6; the most recent earlier one is followed by 9 9.
  const std::vector<TokenId> tokens = {4, 5, 6, 7, 8, 9, 5, 6, 9, 9, 3, 5, 6};
  CHECK((propose(tokens, 1, 3, 2) == std::vector<TokenId>{9, 9}));
  // A longer match wins over a more recent shorter one: "8 9 5" at 4 beats "5" at 11.
  const std::vector<TokenId> longer = {8, 9, 5, 1, 2, 5, 3, 8, 9, 5};
  CHECK((propose(longer, 1, 3, 4) == std::vector<TokenId>{1, 2, 5, 3}));
  // Cut where the tokens end.
  const std::vector<TokenId> end = {1, 2, 1};
  CHECK((propose(end, 1, 2, 5) == std::vector<TokenId>{2, 1}));
}

TEST(no_repeat_or_too_short_a_suffix_proposes_nothing) {
  CHECK(propose({1, 2, 3, 4}, 1, 3, 4).empty());
  CHECK(propose({1}, 1, 3, 4).empty());
  CHECK(propose({}, 1, 3, 4).empty());
  CHECK(propose({7, 8, 1, 7, 9, 7, 8}, 3, 4, 2).empty());  // only 2 tokens repeat
  CHECK((propose({7, 8, 1, 7, 9, 7, 8}, 2, 4, 2) == std::vector<TokenId>{1, 7}));
}

TEST(bad_configs_are_refused) {
  CHECK_THROWS(InvalidArgument, propose({1, 2}, 0, 2, 1));
  CHECK_THROWS(InvalidArgument, propose({1, 2}, 3, 2, 1));
  CHECK_THROWS(InvalidArgument, propose({1, 2}, 1, 2, 0));
}

TEST(the_scheduler_proposes_to_decoding_requests_that_speculate) {
  Scheduler s = testing::make_scheduler(32, 8);
  RequestParams params;
  params.max_tokens = 8;
  params.speculate = true;
  s.add_request("a", std::vector<TokenId>{3, 4, 5, 3}, params);
  s.schedule();
  const TokenId first[] = {4};  // tokens 3 4 5 3 4: "3 4" was followed by 5 3
  s.update(first);
  s.add_request("b", std::vector<TokenId>(12, 1), params);  // its prompt in two chunks
  CHECK_EQ(s.propose_ngram_drafts(NgramConfig{1, 2, 2}), 1);
  s.schedule();
  CHECK_EQ(s.buffers().num_draft_tokens[0], 2);
  CHECK_EQ(s.buffers().input_ids[1], 5);
  CHECK_EQ(s.buffers().input_ids[2], 3);
  // A request added without `speculate` (its tokens sampled) gets no proposal.
  Scheduler plain = testing::make_scheduler(32, 8);
  params.speculate = false;
  plain.add_request("c", std::vector<TokenId>{3, 4, 5, 3}, params);
  plain.schedule();
  plain.update(first);
  CHECK_EQ(plain.propose_ngram_drafts(NgramConfig{1, 2, 2}), 0);
}

TEST_MAIN()
