// How many drafts a request verifies: the count that gains the most tokens per unit of a
// step's cost at its acceptance, against a brute-force expectation; the estimate follows
// a request's verifications and drifts back to the prior while it verifies none; through
// the scheduler, a request whose drafts keep failing is given fewer, then none.
#include <cmath>
#include <vector>

#include "harness.h"
#include "pyengine/draft_budget.h"
#include "pyengine/errors.h"
#include "pyengine/scheduler.h"
#include "scheduler_testing.h"

using namespace pyengine;

namespace {

// Tokens a step gains with d drafts at `rate`, summed over the accepted-run lengths.
double expected_tokens(double rate, int d) {
  double total = 0.0;
  for (int run = 0; run <= d; ++run) {  // `run` drafts accepted, then a rejection (or none)
    const double p = std::pow(rate, run) * (run < d ? 1.0 - rate : 1.0);
    total += p * (run + 1);
  }
  return total;
}

}  // namespace

TEST(the_budget_maximizes_tokens_per_cost_as_brute_force_does) {
  for (const double cost : {0.02, 0.1, 0.2, 0.5, 1.5}) {
    for (const double rate : {0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0}) {
      for (int available = 0; available <= 8; ++available) {
        int best = 0;
        double best_value = 1.0;
        for (int d = 1; d <= available; ++d) {
          const double value = expected_tokens(rate, d) / (1.0 + cost * d);
          if (value > best_value + 1e-12) {
            best_value = value;
            best = d;
          }
        }
        CHECK_EQ(draft_budget(rate, available, cost), best);
      }
    }
  }
  CHECK_EQ(draft_budget(0.0, 5, 0.0), 5);  // free rows: every draft
  CHECK_EQ(draft_budget(1.0, 6, 0.2), 6);  // always accepted: every draft pays
  CHECK_EQ(draft_budget(0.1, 6, 0.2), 0);  // rarely accepted: none
}

TEST(bad_budget_arguments_are_refused) {
  CHECK_THROWS(InvalidArgument, draft_budget(-0.1, 3, 0.2));
  CHECK_THROWS(InvalidArgument, draft_budget(1.1, 3, 0.2));
  CHECK_THROWS(InvalidArgument, draft_budget(0.5, -1, 0.2));
  CHECK_THROWS(InvalidArgument, draft_budget(0.5, 3, -0.2));
  CHECK_THROWS(InvalidArgument, draft_budget(std::nan(""), 3, 0.2));
  DraftAcceptance a;
  CHECK_THROWS(InvalidArgument, a.record(0, 0));
  CHECK_THROWS(InvalidArgument, a.record(2, 3));
  CHECK_THROWS(InvalidArgument, a.record(2, -1));
}

TEST(the_estimate_follows_verifications_and_drifts_back_when_idle) {
  DraftAcceptance a;
  const double prior = a.rate();
  CHECK(prior > 0.5 && prior < 0.9);
  for (int i = 0; i < 10; ++i) a.record(4, 4);
  CHECK(a.rate() > 0.9);
  for (int i = 0; i < 20; ++i) a.record(4, 0);
  CHECK(a.rate() < 0.2);  // recent verifications weigh most
  const double low = a.rate();
  for (int i = 0; i < 200; ++i) a.idle();
  CHECK(a.rate() > low && std::abs(a.rate() - prior) < 0.05);
}

TEST(a_request_whose_drafts_fail_is_given_fewer_then_none_then_tried_again) {
  SchedulerConfig config = testing::scheduler_config(32, 256);
  config.draft_row_cost = 0.2;
  Scheduler s(config, KVCacheConfig{128, 4, true});
  RequestParams params;
  params.max_tokens = 200;
  params.speculate = true;
  s.add_request("a", testing::iota_tokens(5), params);
  CHECK_EQ(s.schedule(), 1);
  const TokenId first[] = {7};
  s.update(first);
  const TokenId drafts[] = {1, 1, 1, 1};
  std::vector<int> scheduled;
  for (int step = 0; step < 40; ++step) {
    s.set_draft_tokens("a", drafts);
    CHECK_EQ(s.schedule(), 1);
    const int d = s.buffers().num_draft_tokens[0];
    scheduled.push_back(d);
    const TokenId own[] = {2};  // every draft rejected: the target's own token
    const int32_t counts[] = {1};
    s.update(own, counts);
  }
  CHECK(scheduled.front() >= 2);  // the prior proposes a few
  CHECK(scheduled[6] == 0);       // a few rejections later, none
  int tried_again = 0;
  for (size_t i = 7; i < scheduled.size(); ++i) tried_again += scheduled[i] > 0 ? 1 : 0;
  CHECK(tried_again >= 2);  // idle steps bring the estimate back: tried again
  CHECK(tried_again <= 8);  // but seldom (of 33 steps)
  s.abort_request("a");
  CHECK_EQ(s.kv_cache().stats().num_used_blocks, 0);
}

TEST(a_negative_row_cost_is_refused) {
  SchedulerConfig config = testing::scheduler_config(32, 32);
  config.draft_row_cost = -1.0;
  CHECK_THROWS(InvalidArgument, Scheduler(config, KVCacheConfig{16, 4, true}));
}

TEST_MAIN()
