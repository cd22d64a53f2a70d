// Scheduler: iteration-level scheduling over the paged KV cache (continuous batching,
// chunked prefill, prefix caching, preemption by recompute), vLLM v1 style.
//
// One engine step:
//   schedule()          picks this step's requests and how many tokens each computes,
//                       within max_num_batched_tokens and max_num_seqs, and writes the
//                       step's flat inputs into buffers() (see StepBuffers);
//   (the model runs; the sampler picks one token per buffers().logits_indices row)
//   update(sampled)     appends them, applies the stop conditions, frees finished
//                       requests and reports per request the new token and finish reason.
// Speculative decoding: set_draft_tokens(id, drafts) before schedule() proposes tokens to
// follow a decoding request; the step computes them after its last token (their KV in
// lookahead slots) and samples a row for each, and update(tokens, counts) takes each
// row's accepted drafts and one token more. A rejected draft's slot is taken back.
// Running requests are served first (a decode token, or the next chunk of a prompt),
// then waiting requests in policy order. When the KV cache runs out, the running
// request that comes last in policy order is preempted: its blocks are freed and it
// waits again, to recompute its prompt and generated tokens (with whatever the prefix
// cache still holds), so that it finishes with exactly the tokens it would have. With
// PreemptionMode::kSwap (and a host tier) its blocks are swapped out to the host tier
// instead, and copied back when it runs again; where the tier has no room, it is
// recomputed.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "pyengine/kv_cache_manager.h"
#include "pyengine/ngram_proposer.h"
#include "pyengine/request.h"
#include "pyengine/scheduler_output.h"
#include "pyengine/suffix_proposer.h"

namespace pyengine {

enum class SchedulingPolicy : uint8_t { kFCFS, kPriority };
enum class PreemptionMode : uint8_t { kRecompute, kSwap };

// The caller sets every field: the engine's defaults live in one place, Python's
// EngineArgs, and a C++ embedder chooses its own. The zeros below only keep a forgotten
// field from being indeterminate: the limits are rejected at 0, and false, 0 and kFCFS
// are the features' off states.
struct SchedulerConfig {
  int max_num_batched_tokens = 0;  // tokens computed in one step, all requests
  int max_num_seqs = 0;            // running requests at most
  int max_model_len = 0;           // prompt plus output tokens of one request
  bool enable_chunked_prefill = false;
  int long_prefill_token_threshold = 0;  // > 0: one request's tokens per step at most
  SchedulingPolicy policy = SchedulingPolicy::kFCFS;
  PreemptionMode preemption_mode = PreemptionMode::kRecompute;  // kSwap: a host tier
  // > 0: the most distinct LoRA adapters (adapter_id != 0) among the running requests,
  // and so in one step (0: no limit). A waiting request whose adapter would exceed it
  // waits; from then on the step admits only requests without an adapter, so that the
  // running adapters drain and it is never starved.
  int max_loras = 0;
  // Speculative decoding: one more token row's cost in a step, against a step of one
  // token; each request verifies as many of its drafts as pay for it (draft_budget; 0:
  // all that fit).
  double draft_row_cost = 0.0;
};

struct SchedulerStats {
  int num_running = 0;
  int num_waiting = 0;
  int64_t num_preemptions = 0;           // since construction
  int64_t num_swapped_preemptions = 0;   // of those, swapped out rather than freed
  int num_scheduled_prefill_tokens = 0;  // last step
  int num_scheduled_decode_tokens = 0;   // last step
  double prefix_cache_hit_rate = 0.0;
  double kv_cache_usage = 0.0;
  // Prompt tokens looked up in the prefix cache, found, and found in the host tier, since
  // construction; the host tier's share of blocks holding KV (cached or swapped out).
  int64_t prefix_cache_queries = 0;
  int64_t prefix_cache_hits = 0;
  int64_t prefix_cache_host_hits = 0;
  double kv_host_usage = 0.0;
};

class Scheduler {
 public:
  // Throws InvalidArgument on non-positive limits, when max_num_batched_tokens is
  // below max_model_len without chunked prefill (a long prompt could never start), or
  // on swap preemption without a host tier.
  Scheduler(const SchedulerConfig& config, const KVCacheConfig& kv_config);

  const SchedulerConfig& config() const { return config_; }

  // Queues a request. With n > 1 its samples 1..n-1 are requests of their own, named
  // sample_id(id, k); they share the prompt's blocks once it is computed. Throws
  // InvalidArgument, changing nothing, on a duplicate id, an empty prompt, a negative
  // token id, max_tokens < 1, min_tokens outside [0, max_tokens], n outside
  // [1, max_num_seqs], a prompt longer than max_model_len, or a request that could
  // never fit in the KV cache.
  void add_request(const std::string& id, std::span<const TokenId> prompt_token_ids,
                   const RequestParams& params);
  // Ends a waiting or running request now, with its samples not yet forked, freeing
  // its blocks. Throws UnknownRequest. A request removed between schedule() and update()
  // gets no token from update(), whose row for it reports the reason; its id cannot be
  // added again until then.
  void abort_request(const std::string& id);
  // Like abort_request but with a reason (Python ends requests on stop strings).
  void finish_request(const std::string& id, FinishReason reason);

  // Plans one step into buffers(). Returns the number of requests scheduled. The step
  // must then be run (its K/V written) before update(): the blocks it fills are already
  // in the prefix cache, and copy-on-write pairs (buffers().block_copies) must be
  // applied in order before the forward pass.
  int schedule();
  const StepBuffers& buffers() const { return buffers_; }

  // Applies the step: sampled_token_ids holds one token per logits_indices row of the
  // last schedule(). Writes results() (rows as in buffers().request_ids) and returns
  // the number of requests that finished. Throws InvalidArgument, changing nothing, on
  // a length mismatch or a negative token id; InvalidState if there was no schedule()
  // since the last update().
  int update(std::span<const TokenId> sampled_token_ids);
  // The same for a step that may have scheduled draft tokens: row i's new tokens are the
  // next num_tokens_per_row[i] of `tokens` (0 for a row that does not sample, 1 to
  // 1 + its draft tokens for one that does), every one before its last the draft token at
  // that place (an accepted draft), applied one at a time until a stop condition. The
  // slots of rejected drafts are taken back. Throws InvalidArgument, changing nothing,
  // on any count or token that breaks this, or a negative token id.
  int update(std::span<const TokenId> tokens, std::span<const int32_t> num_tokens_per_row);
  // Ends the scheduled step as if it had not run (its forward pass failed, for a cause
  // pinned to requests finished during it): each row left gives back the tokens it was
  // scheduled (their blocks leave the prefix cache) and is scheduled again by a later
  // step; no token is added. Throws InvalidState, changing nothing, where the step forked
  // samples or moved KV blocks (swaps, copy-on-write), which it may not have done.
  void cancel_step();

  // Proposes `drafts` to follow request `id`'s tokens (speculative decoding), replacing
  // any earlier proposal. The next schedule() takes as many as fit (the step's token
  // budget, the KV cache, max_model_len and max_tokens) if the request then decodes; a
  // proposal is used by one schedule() at most. Throws UnknownRequest, InvalidArgument
  // on a negative token id.
  void set_draft_tokens(const std::string& id, std::span<const TokenId> drafts);
  // Proposes to every running request that decodes, and was added with
  // params.speculate, the prompt-lookup tokens of its own tokens (propose_ngram), as
  // set_draft_tokens would; returns how many got a proposal.
  int propose_ngram_drafts(const NgramConfig& config);
  // Suffix decoding: from now on the scheduler keeps a SuffixProposer, to which every
  // request added with params.speculate gives its output when it ends (an abort gives
  // none). Throws InvalidArgument on a bad config (check_suffix_config), InvalidState
  // once enabled.
  void enable_suffix_drafts(const SuffixConfig& config);
  // As propose_ngram_drafts, with the SuffixProposer's proposals. Throws InvalidState
  // unless enable_suffix_drafts() ran.
  int propose_suffix_drafts();
  const SuffixProposer* suffix_proposer() const { return suffix_.get(); }
  // Forgets the earlier requests' outputs the suffix proposer holds (as
  // reset_prefix_cache forgets blocks: a benchmark's runs start alike). Throws
  // InvalidState unless enable_suffix_drafts() ran.
  void reset_suffix_cache();
  // Drafts whose tokens the step itself makes (a draft model run before the target):
  // every decoding request that speculates is proposed max_draft placeholder tokens (0),
  // of which schedule() takes as many as fit; set_scheduled_drafts() then gives their
  // tokens, before update(). Returns how many requests got placeholders. Throws
  // InvalidArgument on max_draft < 1.
  int reserve_draft_tokens(int max_draft);
  // The tokens of the last schedule()'s drafts, row after row (buffers().num_draft_tokens
  // of each): they replace the proposals, in the buffers' input_ids too. Throws
  // InvalidState without a scheduled step, InvalidArgument, changing nothing, on a length
  // other than the drafts' or a negative token id.
  void set_scheduled_drafts(std::span<const TokenId> drafts);
  const StepResults& results() const { return results_; }

  // The id of sample k (1 <= k < n) of request `id`.
  static std::string sample_id(const std::string& id, int k) {
    return id + "#" + std::to_string(k);
  }

  bool has_request(const std::string& id) const { return requests_.count(id) > 0; }
  bool has_unfinished_requests() const { return !requests_.empty(); }
  const Request& request(const std::string& id) const;
  SchedulerStats stats() const;
  const KVCacheManager& kv_cache() const { return kv_; }

 private:
  // Waiting requests in policy order: (priority, arrival time, submission order,
  // sample index); unique per request.
  using WaitingKey = std::tuple<int, double, uint64_t, int>;

  WaitingKey waiting_key(const Request& r) const;
  void enqueue_waiting(Request& r);
  void remove(const std::string& id, FinishReason reason);
  // A request about to be destroyed: the suffix proposer takes its output (not an
  // aborted one's) and drops its tree.
  void retire(const Request& r, FinishReason reason);
  // The running requests that decode and take proposals (params.speculate).
  std::vector<Request*> drafting_requests() const;
  // Frees the running request that comes last in policy order and returns it. If it
  // was already scheduled this step, its row leaves `scheduled`, its tokens go back to
  // `budget`, and the prefix-cache entries made for them are taken back first.
  Request* preempt_last_running(std::vector<std::pair<Request*, int>>& scheduled, int& budget);
  // At most long_prefill_token_threshold of a request's remaining tokens, if set.
  int capped_by_threshold(int num_remaining_tokens) const;
  // n of r's tokens from `first` on, ended at a block boundary where states are
  // checkpointed.
  int checkpoint_aligned(const Request& r, int first, int n) const;
  // Sequences that running requests hold or have reserved for samples not yet forked.
  int num_running_seqs() const;
  // Once sample 0's prompt is computed, its samples share its blocks and join the step
  // (rows without tokens that sample from sample 0's logits).
  void fork_samples(Request& r, std::vector<std::pair<Request*, int>>& scheduled);
  void write_step(const std::vector<std::pair<Request*, int>>& scheduled);
  // The draft tokens a decoding request's step can take: its proposal, cut to the token
  // budget left after its own token, max_model_len and max_tokens.
  int drafts_that_fit(const Request& r, int budget) const;
  // Appends row i's new tokens (update), stopping at a stop condition.
  FinishReason append_tokens(Request& r, std::span<const TokenId> tokens, size_t row);
  FinishReason stop_reason(const Request& r, TokenId token) const;

  SchedulerConfig config_;
  KVCacheManager kv_;
  std::unordered_map<std::string, std::unique_ptr<Request>> requests_;
  std::map<WaitingKey, Request*> waiting_;
  std::vector<Request*> running_;           // admission order
  std::unique_ptr<SuffixProposer> suffix_;  // with enable_suffix_drafts
  StepBuffers buffers_;
  StepResults results_;
  std::vector<Request*> step_requests_;             // rows of the last schedule(), until update()
  std::vector<FinishReason> step_removed_reasons_;  // of rows removed during the step
  std::vector<int32_t> one_token_rows_;             // update(sampled)'s counts
  bool step_pending_ = false;
  uint64_t next_arrival_seq_ = 0;
  uint64_t step_index_ = 0;  // schedule() calls, from 1
  int64_t num_preemptions_ = 0;
  int64_t num_swapped_preemptions_ = 0;
  int last_prefill_tokens_ = 0;
  int last_decode_tokens_ = 0;
};

}  // namespace pyengine
