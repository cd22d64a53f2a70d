// Speculative decoding in the scheduler: draft tokens proposed for a decoding request are
// scheduled after its token in lookahead slots, each with a logits row; update takes the
// accepted drafts and one token more, the rejected drafts' slots taken back; every bad
// count or token refused, changing nothing; no block leaked.
#include <vector>

#include "harness.h"
#include "pyengine/errors.h"
#include "pyengine/scheduler.h"
#include "scheduler_testing.h"

using namespace pyengine;

namespace {

Scheduler make(int budget = 16, int max_model_len = 64, int num_blocks = 32) {
  return testing::make_scheduler(num_blocks, budget, max_model_len);
}

using testing::iota_tokens;

// Prefills a request of `prompt` tokens and samples `first`: it decodes from then on.
void start(Scheduler& s, const std::string& id, int prompt, const RequestParams& params,
           TokenId first = 7) {
  s.add_request(id, iota_tokens(prompt), params);
  CHECK_EQ(s.schedule(), 1);
  const TokenId sampled[] = {first};
  s.update(sampled);
}

std::vector<TokenId> tokens_of(const Scheduler& s, const std::string& id) {
  return s.request(id).token_ids;
}

}  // namespace

TEST(drafts_follow_the_decode_token_with_a_logits_row_each) {
  Scheduler s = make();
  RequestParams params;
  params.max_tokens = 10;
  start(s, "a", 5, params);  // tokens 1..5, 7
  const TokenId drafts[] = {8, 9, 10};
  s.set_draft_tokens("a", drafts);
  CHECK_EQ(s.schedule(), 1);
  const StepBuffers& b = s.buffers();
  CHECK_EQ(b.num_tokens, 4);
  CHECK_EQ(b.num_draft_tokens[0], 3);
  CHECK_EQ(b.num_scheduled_tokens[0], 4);
  CHECK_EQ(b.seq_lens[0], 9);
  CHECK_EQ(b.num_sampled, 4);
  for (int t = 0; t < 4; ++t) {
    CHECK_EQ(b.input_ids[static_cast<size_t>(t)], t == 0 ? 7 : 7 + t);
    CHECK_EQ(b.positions[static_cast<size_t>(t)], 5 + t);
    CHECK_EQ(b.logits_indices[static_cast<size_t>(t)], t);
    const int p = 5 + t;
    CHECK_EQ(b.slot_mapping[static_cast<size_t>(t)],
             static_cast<int64_t>(b.block_tables[static_cast<size_t>(p / 4)]) * 4 + p % 4);
  }
  // Two drafts accepted, then a token of the target's own.
  const TokenId accepted[] = {8, 9, 42};
  const int32_t counts[] = {3};
  CHECK_EQ(s.update(accepted, counts), 0);
  CHECK((tokens_of(s, "a") == std::vector<TokenId>{1, 2, 3, 4, 5, 7, 8, 9, 42}));
  CHECK_EQ(s.request("a").num_computed_tokens, 8);  // all but the last: its KV is next
  CHECK_EQ(s.results().token_offsets[0], 0);
  CHECK_EQ(s.results().token_offsets[1], 3);
  CHECK_EQ(s.results().tokens[2], 42);
  CHECK_EQ(s.results().new_token_ids[0], 8);
  CHECK_EQ(s.kv_cache().num_computed_tokens("a"), 8);
  // Without a proposal, the next step is a plain decode of the last token.
  CHECK_EQ(s.schedule(), 1);
  CHECK_EQ(s.buffers().num_tokens, 1);
  CHECK_EQ(s.buffers().input_ids[0], 42);
  CHECK_EQ(s.buffers().positions[0], 8);
  CHECK_EQ(s.buffers().num_draft_tokens[0], 0);
  const TokenId next[] = {43};
  s.update(next);
  CHECK_EQ(s.request("a").num_computed_tokens, 9);
}

TEST(a_rejected_draft_gives_its_slot_back) {
  Scheduler s = make();
  RequestParams params;
  params.max_tokens = 20;
  start(s, "a", 3, params);  // tokens 1..3, 7: the next token at position 4
  const TokenId drafts[] = {8, 9, 10, 11, 12};
  s.set_draft_tokens("a", drafts);
  s.schedule();
  const int blocks_held = 32 - s.kv_cache().num_free_blocks();
  CHECK_EQ(blocks_held, 3);         // positions 3..8: the drafts' lookahead slots
  const TokenId rejected[] = {99};  // the first draft rejected: the target's own token
  const int32_t counts[] = {1};
  s.update(rejected, counts);
  CHECK((tokens_of(s, "a") == std::vector<TokenId>{1, 2, 3, 7, 99}));
  CHECK_EQ(s.request("a").num_computed_tokens, 4);
  // The rejected drafts' slots are written over by the tokens that follow.
  s.schedule();
  CHECK_EQ(s.buffers().input_ids[0], 99);
  CHECK_EQ(s.buffers().positions[0], 4);
  CHECK_EQ(s.buffers().slot_mapping[0], static_cast<int64_t>(s.buffers().block_tables[1]) * 4);
  s.abort_request("a");
  const TokenId ignored[] = {5};  // (the step's row reports the abort)
  s.update(ignored);
  CHECK_EQ(s.kv_cache().num_free_blocks(), 32);
}

TEST(drafts_are_cut_to_the_budget_max_tokens_and_max_model_len) {
  {
    Scheduler s = make(3);  // a step of 3 tokens: the decode token and 2 drafts
    RequestParams params;
    params.max_tokens = 30;
    start(s, "a", 2, params);
    const TokenId drafts[] = {8, 9, 10, 11};
    s.set_draft_tokens("a", drafts);
    s.schedule();
    CHECK_EQ(s.buffers().num_draft_tokens[0], 2);
    CHECK_EQ(s.buffers().num_sampled, 3);
  }
  {
    Scheduler s = make();
    RequestParams params;
    params.max_tokens = 3;  // one generated: 2 more at most, so 1 draft
    start(s, "a", 2, params);
    const TokenId drafts[] = {8, 9, 10};
    s.set_draft_tokens("a", drafts);
    s.schedule();
    CHECK_EQ(s.buffers().num_draft_tokens[0], 1);
    const TokenId tokens[] = {8, 5};
    const int32_t counts[] = {2};
    CHECK_EQ(s.update(tokens, counts), 1);
    CHECK_EQ(s.results().finish_reasons[0], static_cast<uint8_t>(FinishReason::kLength));
    CHECK_EQ(s.kv_cache().num_free_blocks(), 32);
  }
  {
    Scheduler s = make(16, 8);  // max_model_len 8: tokens 1..5, 7 leave room for 2
    RequestParams params;
    params.max_tokens = 30;
    start(s, "a", 5, params);
    const TokenId drafts[] = {8, 9, 10};
    s.set_draft_tokens("a", drafts);
    s.schedule();
    CHECK_EQ(s.buffers().num_draft_tokens[0], 1);
  }
}

TEST(a_stop_token_among_the_accepted_ends_the_request_there) {
  Scheduler s = make();
  RequestParams params;
  params.max_tokens = 20;
  params.eos_token_id = 9;
  start(s, "a", 4, params);
  const TokenId drafts[] = {8, 9, 10};
  s.set_draft_tokens("a", drafts);
  s.schedule();
  const TokenId tokens[] = {8, 9, 10, 11};
  const int32_t counts[] = {4};
  CHECK_EQ(s.update(tokens, counts), 1);
  CHECK_EQ(s.results().finish_reasons[0], static_cast<uint8_t>(FinishReason::kStop));
  CHECK_EQ(s.results().token_offsets[1], 2);  // 8 and the EOS; what follows is dropped
  CHECK(!s.has_unfinished_requests());
  CHECK_EQ(s.kv_cache().num_free_blocks(), 32);
}

TEST(bad_counts_and_tokens_change_nothing) {
  Scheduler s = make();
  RequestParams params;
  params.max_tokens = 20;
  start(s, "a", 4, params);
  const TokenId negative[] = {-1};
  CHECK_THROWS(InvalidArgument, s.set_draft_tokens("a", negative));
  CHECK_THROWS(UnknownRequest, s.set_draft_tokens("b", negative));
  const TokenId drafts[] = {8, 9};
  s.set_draft_tokens("a", drafts);
  s.schedule();
  const TokenId two[] = {8, 4};
  const int32_t too_many[] = {4}, none[] = {0}, two_rows[] = {1, 1};
  const TokenId four[] = {8, 9, 1, 2};
  CHECK_THROWS(InvalidArgument, s.update(four, too_many));  // 1 + 2 drafts at most
  CHECK_THROWS(InvalidArgument, s.update({}, none));        // a sampling row needs one
  CHECK_THROWS(InvalidArgument, s.update(two, two_rows));   // one row only
  const int32_t count_two[] = {2}, count_three[] = {3};
  const TokenId wrong[] = {5, 4};
  CHECK_THROWS(InvalidArgument, s.update(wrong, count_two));  // 5 is not the draft 8
  CHECK_THROWS(InvalidArgument, s.update(two, count_three));  // counts add to 3
  const TokenId bad[] = {8, -4};
  CHECK_THROWS(InvalidArgument, s.update(bad, count_two));
  const TokenId three[] = {7, 7, 7};
  CHECK_THROWS(InvalidArgument, s.update(three));  // one per logits row: no counts
  CHECK((tokens_of(s, "a") == std::vector<TokenId>{1, 2, 3, 4, 7}));
  s.update(two, count_two);
  CHECK((tokens_of(s, "a") == std::vector<TokenId>{1, 2, 3, 4, 7, 8, 4}));
  CHECK_THROWS(InvalidState, s.update(two, count_two));
}

TEST(placeholder_drafts_take_the_tokens_the_step_made) {
  Scheduler s = make();
  RequestParams params;
  params.max_tokens = 10;
  params.speculate = true;
  start(s, "a", 5, params);  // tokens 1..5, 7
  s.add_request("b", iota_tokens(3), params);
  CHECK_EQ(s.schedule(), 2);  // a decodes (nothing reserved), b's prompt
  const TokenId sampled[] = {6, 7};
  s.update(sampled);  // a: 1..5, 7, 6; b: 1..3, 7
  CHECK_EQ(s.reserve_draft_tokens(2), 2);
  CHECK_THROWS(InvalidArgument, s.reserve_draft_tokens(0));
  CHECK_THROWS(InvalidState, s.set_scheduled_drafts(std::vector<TokenId>{}));
  CHECK_EQ(s.schedule(), 2);
  const StepBuffers& b = s.buffers();
  CHECK_EQ(b.num_draft_tokens[0] + b.num_draft_tokens[1], 4);
  CHECK_EQ(b.input_ids[1], 0);  // a placeholder
  // Wrong lengths and negative ids are refused, changing nothing.
  CHECK_THROWS(InvalidArgument, s.set_scheduled_drafts(std::vector<TokenId>{1, 2, 3}));
  CHECK_THROWS(InvalidArgument, s.set_scheduled_drafts(std::vector<TokenId>{1, 2, 3, -4}));
  CHECK_EQ(b.input_ids[1], 0);
  s.set_scheduled_drafts(std::vector<TokenId>{20, 21, 30, 31});
  CHECK_EQ(b.input_ids[1], 20);
  CHECK_EQ(b.input_ids[2], 21);
  CHECK_EQ(b.input_ids[4], 30);
  // The rows keep what their drafts now are: a's both and one more, b's first and another.
  const TokenId tokens[] = {20, 21, 22, 30, 40};
  const int32_t counts[] = {3, 2};
  s.update(tokens, counts);
  CHECK((tokens_of(s, "a") == std::vector<TokenId>{1, 2, 3, 4, 5, 7, 6, 20, 21, 22}));
  CHECK((tokens_of(s, "b") == std::vector<TokenId>{1, 2, 3, 7, 30, 40}));
  // A placeholder the step did not replace is not the token a row accepted.
  CHECK_EQ(s.reserve_draft_tokens(1), 2);
  s.schedule();
  const TokenId unreplaced[] = {5, 6, 8, 9};
  const int32_t two_each[] = {2, 2};
  CHECK_THROWS(InvalidArgument, s.update(unreplaced, two_each));
}

TEST(a_long_run_of_proposals_leaks_no_block) {
  // Two requests decode 24 tokens each, 3 drafts a step, all or one of them accepted in
  // turn: fewer steps than tokens, and every block comes back.
  Scheduler s = make(16, 64, 24);
  RequestParams params;
  params.max_tokens = 24;
  s.add_request("a", iota_tokens(6), params);
  s.add_request("b", iota_tokens(9), params);
  int step = 0;
  while (s.has_unfinished_requests()) {
    for (const std::string id : {"a", "b"}) {
      if (!s.has_request(id)) continue;
      const int n = s.request(id).num_tokens();
      const TokenId drafts[] = {100 + n, 101 + n, 102 + n};
      s.set_draft_tokens(id, drafts);
    }
    CHECK(s.schedule() > 0);
    const StepBuffers& b = s.buffers();
    std::vector<TokenId> tokens;
    std::vector<int32_t> counts;
    for (int i = 0; i < b.num_reqs; ++i) {
      if (b.is_sampling[static_cast<size_t>(i)] == 0) {
        counts.push_back(0);
        continue;
      }
      const int d = b.num_draft_tokens[static_cast<size_t>(i)];
      const int accept = (step + i) % 2 == 0 ? d : d / 2;
      const int first = b.query_start_loc[static_cast<size_t>(i)] + 1;  // the drafts' rows
      for (int j = 0; j < accept; ++j)
        tokens.push_back(b.input_ids[static_cast<size_t>(first + j)]);
      tokens.push_back(50 + step);
      counts.push_back(accept + 1);
    }
    s.update(tokens, counts);
    ++step;
  }
  CHECK(step < 2 * 24);  // fewer steps than one token a step
  CHECK_EQ(s.kv_cache().num_free_blocks(), 24);
}

TEST_MAIN()
