#include <vector>

#include "harness.h"
#include "pyengine/errors.h"
#include "pyengine/scheduler.h"
#include "scheduler_testing.h"

using namespace pyengine;

namespace {

Scheduler make(int num_blocks = 32, int budget = 16) {
  return testing::make_scheduler(num_blocks, budget);
}

using testing::iota_tokens;

// Runs to the end, sampling token 7 everywhere; returns the number of steps.
int run(Scheduler& s) {
  int steps = 0;
  while (s.has_unfinished_requests()) {
    CHECK(s.schedule() > 0);
    const std::vector<TokenId> sampled(static_cast<size_t>(s.buffers().num_sampled), 7);
    s.update(sampled);
    ++steps;
  }
  return steps;
}

}  // namespace

TEST(a_chunked_prompt_then_decodes) {
  Scheduler s = make();
  RequestParams params;
  params.max_tokens = 3;
  s.add_request("a", iota_tokens(20), params);
  CHECK_EQ(s.schedule(), 1);
  const StepBuffers& b = s.buffers();
  CHECK_EQ(b.num_tokens, 16);  // the budget: a first chunk, no token sampled
  CHECK_EQ(b.num_sampled, 0);
  CHECK_EQ(b.positions[15], 15);
  CHECK_EQ(b.slot_mapping[5], static_cast<int64_t>(b.block_tables[1]) * 4 + 1);
  s.update({});
  CHECK_EQ(s.schedule(), 1);
  CHECK_EQ(s.buffers().num_tokens, 4);
  CHECK_EQ(s.buffers().num_sampled, 1);
  CHECK_EQ(s.buffers().logits_indices[0], 3);
  const TokenId first[] = {9};
  CHECK_EQ(s.update(first), 0);
  CHECK_EQ(s.results().new_token_ids[0], 9);
  CHECK_EQ(run(s), 2);
  CHECK_EQ(s.kv_cache().num_free_blocks(), 32);
}

TEST(finish_reasons) {
  Scheduler s = make();
  RequestParams eos;
  eos.eos_token_id = 7;
  s.add_request("eos", iota_tokens(3), eos);
  RequestParams length;
  length.max_tokens = 1;
  s.add_request("length", iota_tokens(3), length);
  s.schedule();
  const std::vector<TokenId> sampled = {7, 7};
  CHECK_EQ(s.update(sampled), 2);
  CHECK_EQ(s.results().finish_reasons[0], static_cast<uint8_t>(FinishReason::kStop));
  CHECK_EQ(s.results().finish_reasons[1], static_cast<uint8_t>(FinishReason::kLength));
  CHECK(!s.has_unfinished_requests());
}

TEST(stop_tokens_in_any_order_with_repeats_stop_each_sample) {
  // The scheduler sorts and deduplicates its copy (binary search per sampled token).
  Scheduler s = make();
  RequestParams params;
  params.max_tokens = 10;
  params.n = 2;
  params.stop_token_ids = {30, 5, 30, 12, 5, 1};
  s.add_request("a", iota_tokens(3), params);
  s.schedule();
  const std::vector<TokenId> first = {4, 12};  // sample 0 goes on, its fork stops at 12
  CHECK_EQ(s.update(first), 1);
  CHECK(s.has_unfinished_requests());
  s.schedule();
  const std::vector<TokenId> next = {6};
  CHECK_EQ(s.update(next), 0);
  s.schedule();
  const std::vector<TokenId> last = {30};
  CHECK_EQ(s.update(last), 1);
  CHECK_EQ(s.results().finish_reasons[0], static_cast<uint8_t>(FinishReason::kStop));
  CHECK(!s.has_unfinished_requests());
  CHECK_EQ(s.kv_cache().num_free_blocks(), 32);
}

TEST(a_cancelled_step_is_scheduled_again_and_caches_nothing) {
  Scheduler s = make();  // blocks of 4 tokens, a budget of 16
  RequestParams params;
  params.max_tokens = 2;
  s.add_request("a", iota_tokens(9), params);
  s.add_request("gone", iota_tokens(5), params);
  CHECK_EQ(s.schedule(), 2);
  s.finish_request("gone", FinishReason::kAbort);  // (the cause, finished during the step)
  s.cancel_step();
  CHECK_THROWS(InvalidState, s.cancel_step());
  CHECK_EQ(s.schedule(), 1);  // a, its whole prompt again
  CHECK_EQ(s.buffers().num_scheduled_tokens[0], 9);
  CHECK_EQ(s.buffers().positions[0], 0);
  s.cancel_step();
  s.finish_request("a", FinishReason::kAbort);
  // Its two full blocks left the prefix cache: a request of the same prompt finds none.
  s.add_request("b", iota_tokens(9), params);
  CHECK_EQ(s.schedule(), 1);
  CHECK_EQ(s.buffers().num_scheduled_tokens[0], 9);
  CHECK_EQ(s.update(std::vector<TokenId>{3}), 0);
  CHECK_EQ(run(s), 1);
  CHECK_EQ(s.kv_cache().num_free_blocks(), 32);
}

TEST(bad_input_changes_nothing) {
  Scheduler s = make(8);
  RequestParams params;
  s.add_request("a", iota_tokens(3), params);
  CHECK_THROWS(InvalidArgument, s.add_request("a", iota_tokens(3), params));
  CHECK_THROWS(InvalidArgument, s.add_request("b", {}, params));
  params.max_tokens = 0;
  CHECK_THROWS(InvalidArgument, s.add_request("b", iota_tokens(3), params));
  params.max_tokens = 40;
  CHECK_THROWS(InvalidArgument, s.add_request("b", iota_tokens(30), params));  // > 8 blocks
  CHECK_THROWS(UnknownRequest, s.abort_request("b"));
  CHECK_THROWS(InvalidState, s.update({}));
  CHECK_EQ(s.stats().num_waiting, 1);
  CHECK_EQ(run(s), 16);
}

TEST(a_config_left_unset_is_rejected) {
  // No engine defaults in C++ (they are Python's EngineArgs'): unset limits are an error.
  CHECK_THROWS(InvalidArgument, Scheduler(SchedulerConfig{}, KVCacheConfig{8, 4, true}));
}

// Recurrent-state slots: each step carries every request's slot and whether it holds
// its state; with fewer slots than max_num_seqs, admission waits for one; a finished
// request's slot serves the next.
// A scheduler whose KV-cache manager keeps `slots` recurrent-state slots (no prefix
// caching).
static Scheduler with_state_slots(int slots) {
  KVCacheConfig kv{32, 4, false};
  kv.num_state_slots = slots;
  return Scheduler(testing::scheduler_config(16), kv);
}

TEST(state_slots_reach_the_step_and_bound_admission) {
  Scheduler s = with_state_slots(2);
  RequestParams params;
  params.max_tokens = 2;
  s.add_request("a", iota_tokens(10), params);
  s.add_request("b", iota_tokens(3), params);
  s.add_request("c", iota_tokens(2), params);
  CHECK_EQ(s.schedule(), 2);  // c waits for a slot though blocks and budget are left
  const StepBuffers& b = s.buffers();
  CHECK(b.request_ids[0] == "a" && b.request_ids[1] == "b");
  CHECK(b.state_slots[0] == 0 && b.state_slots[1] == 1);
  CHECK(b.has_state[0] == 0 && b.has_state[1] == 0);  // (their prompts start)
  const TokenId sampled[] = {7, 7};
  s.update(sampled);
  CHECK_EQ(s.schedule(), 2);  // decodes: their slots hold their states
  CHECK(s.buffers().state_slots[0] == 0 && s.buffers().has_state[0] == 1);
  CHECK(s.buffers().state_slots[1] == 1 && s.buffers().has_state[1] == 1);
  s.update(sampled);  // (both reach max_tokens and finish: their slots free)
  CHECK_EQ(s.schedule(), 1);
  CHECK(s.buffers().request_ids[0] == "c" && s.buffers().has_state[0] == 0);
  CHECK(s.buffers().state_slots[0] == 0 || s.buffers().state_slots[0] == 1);
  CHECK(s.buffers().state_copies.empty());
  const TokenId one[] = {7};
  s.update(one);
  CHECK_EQ(run(s), 1);
  CHECK_EQ(s.kv_cache().num_free_state_slots(), 2);
}

TEST(a_forked_samples_state_is_copied_from_its_parents_after_the_forking_step) {
  Scheduler s = with_state_slots(3);
  RequestParams params;
  params.max_tokens = 2;
  params.n = 2;
  s.add_request("a", iota_tokens(6), params);
  CHECK_EQ(s.schedule(), 2);  // the prompt, and its second sample forked from it
  const StepBuffers& b = s.buffers();
  CHECK(b.state_slots[0] == 0 && b.has_state[0] == 0);
  CHECK_EQ(b.state_slots[1], 1);
  CHECK(b.state_copies.size() == 1 && b.state_copies[0] == std::make_pair(0, 1));
  const TokenId sampled[] = {7, 8};
  s.update(sampled);
  CHECK_EQ(s.schedule(), 2);  // both decode from their own slots' states
  CHECK(s.buffers().has_state[0] == 1 && s.buffers().has_state[1] == 1);
  CHECK(s.buffers().state_slots[0] != s.buffers().state_slots[1]);
  CHECK(s.buffers().state_copies.empty());
  s.update(sampled);
  CHECK(!s.has_unfinished_requests());
  CHECK_EQ(s.kv_cache().num_free_state_slots(), 3);
}

TEST_MAIN()
