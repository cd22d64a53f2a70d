// How many of a request's draft tokens a step verifies (speculative decoding). A
// verifying step costs each draft token a row of the target's compute, and gains one
// token for each draft accepted in a row from the first: so a request whose drafts are
// rarely accepted gets fewer of them, or none, where each costs more than it is expected
// to gain. The acceptance of each request is estimated from its own recent verifications
// (older ones weigh less), from a prior for a request with none; a request given no drafts
// drifts back to the prior step by step, so that it is tried again.
#pragma once

namespace pyengine {

class DraftAcceptance {
 public:
  // The chance that a draft is accepted given that every draft before it was.
  double rate() const;

  // A verification of `proposed` drafts, `accepted` of them (from the first) accepted.
  // Throws InvalidArgument unless 0 <= accepted <= proposed and proposed >= 1.
  void record(int proposed, int accepted);

  // A step in which it verified no drafts.
  void idle();

 private:
  double accepted_ = 0.0;  // drafts accepted, each verification weighed by its age
  double trials_ = 0.0;    // drafts judged (those accepted, and the first rejected)
};

// The number of drafts, at most `available`, that maximizes the tokens a step gains per
// unit of its cost, (1 - rate^(d+1)) / (1 - rate) against 1 + row_cost * d; 0 where no
// count gains more than it costs. row_cost: one more token row's cost, against a step of
// one token (0: drafts are free, all of them). Throws InvalidArgument for a negative
// row_cost, a rate outside [0, 1] or a negative count.
int draft_budget(double rate, int available, double row_cost);

}  // namespace pyengine
