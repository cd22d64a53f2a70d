#include "pyengine/draft_budget.h"

#include <string>

#include "pyengine/errors.h"

namespace pyengine {
namespace {

// A verification's weight after each later one (a request's acceptance drifts as its
// output moves between copied spans and new text), and after each step without drafts.
// Slow when idle: a request that gains nothing from drafts is tried again seldom.
constexpr double kVerifiedDecay = 0.8;
constexpr double kIdleDecay = 0.97;
// The prior: as if one draft had been judged at this rate, which proposes a few.
constexpr double kPriorRate = 0.7;
constexpr double kPriorTrials = 1.0;

}  // namespace

double DraftAcceptance::rate() const {
  return (accepted_ + kPriorRate * kPriorTrials) / (trials_ + kPriorTrials);
}

void DraftAcceptance::record(int proposed, int accepted) {
  if (proposed < 1 || accepted < 0 || accepted > proposed) {
    throw InvalidArgument("DraftAcceptance.record: " + std::to_string(accepted) +
                          " drafts accepted of " + std::to_string(proposed) + " proposed");
  }
  // (the first rejected draft was judged too; those after it were not)
  const int judged = accepted + (accepted < proposed ? 1 : 0);
  accepted_ = accepted_ * kVerifiedDecay + accepted;
  trials_ = trials_ * kVerifiedDecay + judged;
}

void DraftAcceptance::idle() {
  accepted_ *= kIdleDecay;
  trials_ *= kIdleDecay;
}

int draft_budget(double rate, int available, double row_cost) {
  if (!(row_cost >= 0.0) || !(rate >= 0.0 && rate <= 1.0) || available < 0) {
    throw InvalidArgument("draft_budget: rate " + std::to_string(rate) + ", " +
                          std::to_string(available) + " drafts and row cost " +
                          std::to_string(row_cost) +
                          " (need a rate in [0, 1], a count >= 0, a cost >= 0)");
  }
  if (row_cost == 0.0) return available;
  int best = 0;
  double best_value = 1.0;  // no drafts: one token for one token's step
  double expected = 1.0;    // tokens gained with d drafts: 1 + rate + ... + rate^d
  double term = 1.0;
  for (int d = 1; d <= available; ++d) {
    term *= rate;
    expected += term;
    const double value = expected / (1.0 + row_cost * d);
    if (value > best_value) {
      best_value = value;
      best = d;
    }
  }
  return best;
}

}  // namespace pyengine
