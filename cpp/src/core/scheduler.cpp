#include "pyengine/scheduler.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "pyengine/errors.h"

namespace pyengine {
namespace {

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

const SchedulerConfig& checked(const SchedulerConfig& c, const KVCacheConfig& kv) {
  check_argument(c.preemption_mode != PreemptionMode::kSwap || kv.num_host_blocks > 0,
                 "swap preemption needs a host tier (num_host_blocks > 0)");
  check_argument(c.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive");
  check_argument(c.max_num_seqs > 0, "max_num_seqs must be positive");
  check_argument(c.max_model_len > 0, "max_model_len must be positive");
  check_argument(c.long_prefill_token_threshold >= 0,
                 "long_prefill_token_threshold must be non-negative");
  check_argument(c.max_loras >= 0, "max_loras must be non-negative");
  check_argument(c.draft_row_cost >= 0.0, "draft_row_cost must be non-negative");
  check_argument(c.enable_chunked_prefill || c.max_num_batched_tokens >= c.max_model_len,
                 "without chunked prefill, max_num_batched_tokens must be at least "
                 "max_model_len (a long prompt could never be scheduled)");
  return c;
}

}  // namespace

Scheduler::Scheduler(const SchedulerConfig& config, const KVCacheConfig& kv_config)
    : config_(checked(config, kv_config)),
      kv_(kv_config),
      buffers_(config.max_num_batched_tokens, config.max_num_seqs,
               ceil_div(config.max_model_len, kv_config.block_size), kv_.num_groups()),
      results_(config.max_num_seqs, config.max_num_batched_tokens) {
  running_.reserve(static_cast<size_t>(config.max_num_seqs));
  step_requests_.reserve(static_cast<size_t>(config.max_num_seqs));
}

Scheduler::WaitingKey Scheduler::waiting_key(const Request& r) const {
  const int priority = config_.policy == SchedulingPolicy::kPriority ? r.params.priority : 0;
  return {priority, r.params.arrival_time, r.arrival_seq, r.sample_index};
}

void Scheduler::enqueue_waiting(Request& r) {
  r.status = RequestStatus::kWaiting;
  waiting_.emplace(waiting_key(r), &r);
}

const Request& Scheduler::request(const std::string& id) const {
  const auto it = requests_.find(id);
  if (it == requests_.end()) throw UnknownRequest(id);
  return *it->second;
}

void Scheduler::add_request(const std::string& id, std::span<const TokenId> prompt_token_ids,
                            const RequestParams& params) {
  if (has_request(id)) throw InvalidArgument("add_request: request id '" + id + "' already exists");
  for (size_t i = 0; i < step_requests_.size(); ++i) {
    // Its row still reports the removal in the next update(): one id, one request.
    if (step_requests_[i] == nullptr && buffers_.request_ids[i] == id) {
      throw InvalidArgument("add_request: request id '" + id +
                            "' ended during the scheduled step; add it again after update()");
    }
  }
  check_argument(!prompt_token_ids.empty(), "add_request: the prompt is empty");
  for (const TokenId t : prompt_token_ids) {
    if (t < 0) throw InvalidArgument("add_request: token id " + std::to_string(t) + " is negative");
  }
  check_argument(params.max_tokens >= 1, "add_request: max_tokens must be at least 1");
  check_argument(params.min_tokens >= 0 && params.min_tokens <= params.max_tokens,
                 "add_request: min_tokens must be in [0, max_tokens]");
  check_argument(params.n >= 1 && params.n <= config_.max_num_seqs,
                 "add_request: n must be in [1, max_num_seqs]");
  check_argument(std::isfinite(params.arrival_time), "add_request: arrival_time must be finite");
  for (const TokenId t : params.stop_token_ids) {
    check_argument(t >= 0, "add_request: stop_token_ids must be non-negative");
  }
  const auto prompt_len = static_cast<int64_t>(prompt_token_ids.size());
  if (prompt_len > config_.max_model_len) {
    throw InvalidArgument("add_request: the prompt has " + std::to_string(prompt_len) +
                          " tokens, more than max_model_len (" +
                          std::to_string(config_.max_model_len) + ")");
  }
  const int64_t max_len = std::min<int64_t>(prompt_len + params.max_tokens, config_.max_model_len);
  const int64_t blocks_needed = kv_.max_blocks_held(max_len, config_.max_num_batched_tokens);
  if (blocks_needed > kv_.config().num_blocks) {
    throw InvalidArgument("add_request: the request needs up to " + std::to_string(blocks_needed) +
                          " KV-cache blocks, the pool has " +
                          std::to_string(kv_.config().num_blocks));
  }
  // Sample 0 under `id`, samples 1..n-1 under sample_id(id, k): all built, then all
  // registered, so that a failure leaves nothing behind.
  std::vector<std::unique_ptr<Request>> samples;
  for (int k = 0; k < params.n; ++k) {
    auto r = std::make_unique<Request>();
    r->id = k == 0 ? id : sample_id(id, k);
    if (k > 0 && has_request(r->id)) {
      throw InvalidArgument("add_request: the id of sample " + std::to_string(k) + ", '" + r->id +
                            "', is taken");
    }
    r->params = params;
    if (k == 0) {
      // Sorted and each once: a sampled token is looked up in log time, however many a
      // request names.
      std::vector<TokenId>& stops = r->params.stop_token_ids;
      std::ranges::sort(stops);
      stops.erase(std::unique(stops.begin(), stops.end()), stops.end());
    } else {
      r->params.stop_token_ids = samples[0]->params.stop_token_ids;
    }
    r->token_ids.assign(prompt_token_ids.begin(), prompt_token_ids.end());
    r->num_prompt_tokens = static_cast<int>(prompt_len);
    r->sample_index = k;
    if (k > 0) {
      r->params.n = 1;
      r->parent_id = id;
      r->status = RequestStatus::kForkPending;
      samples[0]->sample_ids.push_back(r->id);
    }
    samples.push_back(std::move(r));
  }
  requests_.reserve(requests_.size() + samples.size());  // the emplaces below cannot fail
  samples[0]->arrival_seq = next_arrival_seq_++;
  Request& first = *samples[0];
  for (auto& r : samples) {
    r->arrival_seq = first.arrival_seq;
    std::string key = r->id;
    requests_.emplace(std::move(key), std::move(r));
  }
  enqueue_waiting(first);
}

void Scheduler::remove(const std::string& id, FinishReason reason) {
  const auto it = requests_.find(id);
  if (it == requests_.end()) throw UnknownRequest(id);
  Request* r = it->second.get();
  if (r->status == RequestStatus::kWaiting) {
    waiting_.erase(waiting_key(*r));
  } else if (r->status == RequestStatus::kRunning) {
    running_.erase(std::find(running_.begin(), running_.end(), r));
  }
  if (kv_.has_request(id)) kv_.free(id);
  // A step in flight keeps a row for it: update() reports `reason` there.
  for (size_t i = 0; i < step_requests_.size(); ++i) {
    if (step_requests_[i] == r) {
      step_requests_[i] = nullptr;
      step_removed_reasons_[i] = reason;
    }
  }
  const std::vector<std::string> unforked =
      r->forked ? std::vector<std::string>{} : std::move(r->sample_ids);
  retire(*r, reason);
  requests_.erase(it);
  for (const std::string& sample : unforked) {
    const auto s = requests_.find(sample);
    if (s != requests_.end() && s->second->status == RequestStatus::kForkPending) {
      requests_.erase(s);
    }
  }
}

void Scheduler::abort_request(const std::string& id) { remove(id, FinishReason::kAbort); }

void Scheduler::finish_request(const std::string& id, FinishReason reason) {
  check_argument(reason != FinishReason::kNone, "finish_request: a finish reason is required");
  remove(id, reason);
}

Request* Scheduler::preempt_last_running(std::vector<std::pair<Request*, int>>& scheduled,
                                         int& budget) {
  // Requests forked this step are spared: their samples take this step's logits of
  // sample 0, whose prompt is being computed.
  const auto spared = [this](const Request* r) { return r->fork_step == step_index_; };
  auto last = running_.end();
  for (auto it = running_.begin(); it != running_.end(); ++it) {
    if (!spared(*it) && (last == running_.end() || waiting_key(**last) < waiting_key(**it))) {
      last = it;
    }
  }
  if (last == running_.end()) throw InvalidState("preempt: no running request can be preempted");
  Request* victim = *last;
  running_.erase(last);
  const auto row = std::find_if(scheduled.begin(), scheduled.end(),
                                [victim](const auto& s) { return s.first == victim; });
  if (row != scheduled.end()) {
    // Its blocks were cached as if this step's tokens would be computed: they won't.
    kv_.rollback(victim->id, victim->num_computed_tokens - row->second);
    budget += row->second + victim->num_scheduled_drafts;
    scheduled.erase(row);
  }
  victim->num_scheduled_drafts = 0;
  if (config_.preemption_mode == PreemptionMode::kSwap && kv_.can_swap_out(victim->id)) {
    kv_.swap_out(victim->id);  // it keeps its computed tokens
    victim->num_computed_tokens = kv_.num_computed_tokens(victim->id);
    ++num_swapped_preemptions_;
  } else {
    kv_.free(victim->id);
    victim->num_computed_tokens = 0;
  }
  ++victim->num_preemptions;
  ++num_preemptions_;
  enqueue_waiting(*victim);
  return victim;
}

int Scheduler::capped_by_threshold(int num_remaining_tokens) const {
  const int threshold = config_.long_prefill_token_threshold;
  return threshold > 0 ? std::min(num_remaining_tokens, threshold) : num_remaining_tokens;
}

int Scheduler::checkpoint_aligned(const Request& r, int first, int n) const {
  // With recurrent-state checkpoints, a chunk of known tokens ends where the manager
  // checkpoints the state (every state_checkpoint_interval blocks), and the prompt's
  // last full block ends a step of its own: a later prompt that shares it resumes there.
  const KVCacheConfig& kv = kv_.config();
  if (kv.num_state_checkpoints == 0) return n;
  // (first + n never passes the known tokens: it ends a chunk or the prompt)
  const int size = kv_.block_size(), unit = size * kv.state_checkpoint_interval;
  const int end = first + n;
  const int prompt_blocks_end = r.num_prompt_tokens / size * size;
  int aligned = end / unit * unit;
  if (prompt_blocks_end < end) aligned = std::max(aligned, prompt_blocks_end);
  return aligned > first && aligned < end ? aligned - first : n;
}

int Scheduler::num_running_seqs() const {
  int seqs = static_cast<int>(running_.size());
  for (const Request* r : running_) {
    if (!r->forked) seqs += static_cast<int>(r->sample_ids.size());
  }
  return seqs;
}

void Scheduler::fork_samples(Request& r, std::vector<std::pair<Request*, int>>& scheduled) {
  if (r.sample_ids.empty() || r.forked || r.num_computed_tokens != r.num_tokens()) return;
  r.forked = true;
  r.fork_step = step_index_;
  for (const std::string& id : r.sample_ids) {
    const auto it = requests_.find(id);
    if (it == requests_.end() || it->second->status != RequestStatus::kForkPending) continue;
    Request& sample = *it->second;
    kv_.fork(r.id, sample.id);
    sample.kv_handle = kv_.handle(sample.id);
    sample.num_computed_tokens = r.num_computed_tokens;
    sample.status = RequestStatus::kRunning;
    sample.fork_step = step_index_;
    sample.num_scheduled_drafts = 0;
    running_.push_back(&sample);
    scheduled.emplace_back(&sample, 0);  // right after r: it samples from r's logits
  }
}

int Scheduler::schedule() {
  if (step_pending_) throw InvalidState("schedule: the last step has not been update()d");
  ++step_index_;
  int budget = config_.max_num_batched_tokens;
  std::vector<std::pair<Request*, int>> scheduled;
  scheduled.reserve(running_.size() + waiting_.size());
  bool preempted = false;

  // Running requests first: a decode token each (and the draft tokens proposed to follow
  // it), or their prompt's next chunk.
  for (Request* r : running_) r->num_scheduled_drafts = 0;
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Request* r = running_[i];
    const int n = checkpoint_aligned(
        *r, r->num_computed_tokens,
        std::min(capped_by_threshold(r->num_tokens() - r->num_computed_tokens), budget));
    if (n == 0) {  // a sample forked this step: it has nothing to compute
      ++i;
      continue;
    }
    const bool decoding = n == 1 && r->num_computed_tokens == r->num_tokens() - 1;
    int drafts = decoding ? drafts_that_fit(*r, budget) : 0;
    if (decoding && drafts == 0 && !r->draft_token_ids.empty()) {
      r->draft_acceptance.idle();  // proposed, but verifies none this step
    }
    // (no room for the drafts' slots: the step goes without them before anyone is preempted)
    if (drafts > 0 && !kv_.allocate_slots(r->kv_handle, n, drafts).has_value()) drafts = 0;
    bool allocated = drafts > 0;
    while (!allocated && !(allocated = kv_.allocate_slots(r->kv_handle, n).has_value())) {
      const auto position =
          static_cast<size_t>(std::find(running_.begin(), running_.end(), r) - running_.begin());
      Request* victim = preempt_last_running(scheduled, budget);
      preempted = true;
      if (victim == r) break;
      if (running_.size() <= position || running_[position] != r) --i;  // it sat before r
    }
    // r itself came last in policy order and was preempted; the requests after it in
    // running_ come before it in policy order, and may fit in the blocks it freed.
    if (!allocated) continue;
    r->num_computed_tokens += n;
    r->num_scheduled_drafts = drafts;
    // A recurrent state takes in every token the step runs, a draft that will be rejected
    // too: it is saved before the step (update puts it back).
    if (drafts > 0 && kv_.config().state_snapshots) kv_.snapshot_state(r->kv_handle);
    scheduled.emplace_back(r, n);
    budget -= n + drafts;
    fork_samples(*r, scheduled);
    ++i;
  }
  // A proposal serves one step: what it did not schedule is dropped.
  for (Request* r : running_) {
    r->draft_token_ids.resize(static_cast<size_t>(r->num_scheduled_drafts));
  }

  // Then waiting requests in policy order, unless this step had to preempt. A request
  // with samples still to fork brings their sequences along.
  int num_seqs = num_running_seqs();
  std::vector<int64_t> adapters;  // the running requests' (max_loras > 0)
  if (config_.max_loras > 0) {
    for (const Request* r : running_) {
      const int64_t a = r->params.adapter_id;
      if (a != 0 && std::find(adapters.begin(), adapters.end(), a) == adapters.end()) {
        adapters.push_back(a);
      }
    }
  }
  bool adapter_waits = false;  // a request waits for an adapter slot: admit no other adapter
  for (auto it = waiting_.begin(); !preempted && budget > 0 && it != waiting_.end();) {
    Request* r = it->second;
    const int64_t adapter = r->params.adapter_id;
    const bool budgeted = config_.max_loras > 0 && adapter != 0;
    const bool new_adapter =
        budgeted && std::find(adapters.begin(), adapters.end(), adapter) == adapters.end();
    if (budgeted && (adapter_waits ||
                     (new_adapter && static_cast<int>(adapters.size()) == config_.max_loras))) {
      adapter_waits = true;
      ++it;
      continue;
    }
    const int seqs = r->forked ? 1 : 1 + static_cast<int>(r->sample_ids.size());
    if (num_seqs + seqs > config_.max_num_seqs) break;
    if (!kv_.has_request(r->id)) {
      kv_.add_request(r->id, r->token_ids, BlockExtras{r->params.adapter_id, r->params.cache_salt});
      r->kv_handle = kv_.handle(r->id);
    }
    // A swapped-out request takes its own blocks back; any other looks up the cache.
    const bool swapped = kv_.is_swapped(r->id);
    ComputedBlocks hit = swapped ? ComputedBlocks{} : kv_.get_computed_blocks(r->id);
    const int computed = swapped ? r->num_computed_tokens : hit.num_computed_tokens;
    int n = capped_by_threshold(r->num_tokens() - computed);
    if (!config_.enable_chunked_prefill && n > budget) break;
    n = checkpoint_aligned(*r, computed, std::min(n, budget));
    if (!kv_.allocate_slots(r->id, n, 0, &hit)) break;
    it = waiting_.erase(it);
    if (new_adapter) adapters.push_back(adapter);
    r->status = RequestStatus::kRunning;
    r->draft_token_ids.clear();  // (a prefill proposes nothing)
    r->num_scheduled_drafts = 0;
    r->num_computed_tokens = computed + n;
    if (r->num_preemptions == 0) r->num_host_cached_tokens = hit.num_host_tokens;
    running_.push_back(r);
    num_seqs += seqs;
    scheduled.emplace_back(r, n);
    budget -= n;
    fork_samples(*r, scheduled);
  }

  write_step(scheduled);
  step_pending_ = true;
  return buffers_.num_reqs;
}

void Scheduler::write_step(const std::vector<std::pair<Request*, int>>& scheduled) {
  StepBuffers& b = buffers_;
  const int block_size = kv_.block_size();
  b.num_reqs = static_cast<int>(scheduled.size());
  b.num_tokens = 0;
  b.num_sampled = 0;
  b.query_start_loc[0] = 0;
  b.request_ids.resize(scheduled.size());
  step_requests_.clear();
  step_removed_reasons_.assign(scheduled.size(), FinishReason::kNone);
  last_prefill_tokens_ = last_decode_tokens_ = 0;
  for (size_t i = 0; i < scheduled.size(); ++i) {
    const auto& [r, n] = scheduled[i];
    const int first = r->num_computed_tokens - n;
    const int drafts = r->num_scheduled_drafts;  // (their slots follow the known tokens')
    const int row_start = b.num_tokens;
    for (int p = first; p < r->num_computed_tokens + drafts; ++p) {
      const auto t = static_cast<size_t>(b.num_tokens++);
      b.input_ids[t] = p < r->num_computed_tokens
                           ? r->token_ids[static_cast<size_t>(p)]
                           : r->draft_token_ids[static_cast<size_t>(p - r->num_computed_tokens)];
      b.positions[t] = p;
    }
    for (int g = 0; g < b.num_kv_groups; ++g) {
      const std::span<const BlockId> table = kv_.block_table(r->kv_handle, g);
      int64_t* slots = b.slot_mapping.data() + static_cast<ptrdiff_t>(g) * b.max_num_batched_tokens;
      for (int t = row_start; t < b.num_tokens; ++t) {
        const int p = b.positions[static_cast<size_t>(t)];
        slots[t] = static_cast<int64_t>(table[static_cast<size_t>(p / block_size)]) * block_size +
                   p % block_size;
      }
      std::copy(table.begin(), table.end(),
                b.block_tables.begin() +
                    (static_cast<ptrdiff_t>(g) * b.max_num_seqs + static_cast<ptrdiff_t>(i)) *
                        b.max_blocks_per_request);
    }
    b.query_start_loc[i + 1] = b.num_tokens;
    b.seq_lens[i] = r->num_computed_tokens + drafts;
    b.num_scheduled_tokens[i] = n + drafts;
    b.num_draft_tokens[i] = drafts;
    b.state_slots[i] = kv_.state_slot(r->kv_handle);
    b.has_state[i] = first > 0 ? 1 : 0;  // (a prefix hit's state loads before the step)
    const bool sampling = r->num_computed_tokens == r->num_tokens();
    b.is_sampling[i] = sampling ? 1 : 0;
    // The last token's row, then each draft's: a row for every token the step may accept.
    for (int j = drafts; sampling && j >= 0; --j) {
      b.logits_indices[static_cast<size_t>(b.num_sampled++)] = b.num_tokens - 1 - j;
    }
    b.request_ids[i] = r->id;
    step_requests_.push_back(r);
    // A decode step computes only the last sampled token.
    (first == r->num_tokens() - 1 && r->num_output_tokens() > 0 ? last_decode_tokens_
                                                                : last_prefill_tokens_) +=
        n + drafts;
    // A sample forked this step has no tokens: its logits row is sample 0's last one,
    // which precedes it (b.num_tokens - 1 above already points there).
  }
  // A step of no request is not run: its copies (a preemption's swap-out) wait for the
  // next step's, ahead of them.
  b.kv_transfers = scheduled.empty() ? KVTransfers{} : kv_.take_pending_transfers();
  b.block_copies = kv_.take_pending_copies();
  b.state_copies = kv_.take_pending_state_copies();
  b.state_loads = kv_.take_pending_state_loads();
}

FinishReason Scheduler::stop_reason(const Request& r, TokenId token) const {
  const RequestParams& p = r.params;
  if (r.num_output_tokens() >= p.min_tokens) {
    if (!p.ignore_eos && p.eos_token_id != kNoToken && token == p.eos_token_id) {
      return FinishReason::kStop;
    }
    if (std::ranges::binary_search(p.stop_token_ids, token)) {
      return FinishReason::kStop;
    }
  }
  if (r.num_output_tokens() >= p.max_tokens || r.num_tokens() >= config_.max_model_len) {
    return FinishReason::kLength;
  }
  return FinishReason::kNone;
}

int Scheduler::drafts_that_fit(const Request& r, int budget) const {
  const int proposed = static_cast<int>(r.draft_token_ids.size());
  // (every token it may accept within max_model_len and max_tokens, its last one's too)
  const int by_length = config_.max_model_len - r.num_tokens() - 1;
  const int by_max_tokens = r.params.max_tokens - r.num_output_tokens() - 1;
  const int fit = std::max(0, std::min({proposed, budget - 1, by_length, by_max_tokens}));
  return draft_budget(r.draft_acceptance.rate(), fit, config_.draft_row_cost);
}

void Scheduler::set_draft_tokens(const std::string& id, std::span<const TokenId> drafts) {
  const auto it = requests_.find(id);
  if (it == requests_.end()) throw UnknownRequest(id);
  for (const TokenId t : drafts) {
    if (t < 0) {
      throw InvalidArgument("set_draft_tokens: token id " + std::to_string(t) + " is negative");
    }
  }
  it->second->draft_token_ids.assign(drafts.begin(), drafts.end());
}

std::vector<Request*> Scheduler::drafting_requests() const {
  std::vector<Request*> drafting;
  for (Request* r : running_) {
    // (not a prefill's chunks)
    if (r->params.speculate && r->num_computed_tokens == r->num_tokens() - 1) {
      drafting.push_back(r);
    }
  }
  return drafting;
}

int Scheduler::propose_ngram_drafts(const NgramConfig& config) {
  check_ngram_config(config);
  int proposed = 0;
  for (Request* r : drafting_requests()) {
    r->draft_token_ids = propose_ngram(r->token_ids, config);
    proposed += r->draft_token_ids.empty() ? 0 : 1;
  }
  return proposed;
}

void Scheduler::enable_suffix_drafts(const SuffixConfig& config) {
  if (suffix_) throw InvalidState("enable_suffix_drafts: suffix decoding is enabled already");
  suffix_ = std::make_unique<SuffixProposer>(config);
}

int Scheduler::propose_suffix_drafts() {
  if (!suffix_) throw InvalidState("propose_suffix_drafts: enable_suffix_drafts() first");
  int proposed = 0;
  for (Request* r : drafting_requests()) {
    r->draft_token_ids = suffix_->propose(r->id, r->token_ids);
    proposed += r->draft_token_ids.empty() ? 0 : 1;
  }
  return proposed;
}

void Scheduler::reset_suffix_cache() {
  if (!suffix_) throw InvalidState("reset_suffix_cache: suffix decoding is off");
  suffix_->clear_outputs();
}

int Scheduler::reserve_draft_tokens(int max_draft) {
  check_argument(max_draft >= 1, "reserve_draft_tokens: max_draft must be at least 1");
  int proposed = 0;
  for (Request* r : drafting_requests()) {
    r->draft_token_ids.assign(static_cast<size_t>(max_draft), 0);
    ++proposed;
  }
  return proposed;
}

void Scheduler::set_scheduled_drafts(std::span<const TokenId> drafts) {
  if (!step_pending_) throw InvalidState("set_scheduled_drafts: no step is scheduled");
  const auto num_reqs = static_cast<size_t>(buffers_.num_reqs);
  size_t total = 0;
  for (size_t i = 0; i < num_reqs; ++i) total += static_cast<size_t>(buffers_.num_draft_tokens[i]);
  if (drafts.size() != total) {
    throw InvalidArgument("set_scheduled_drafts: the step scheduled " + std::to_string(total) +
                          " draft tokens, got " + std::to_string(drafts.size()));
  }
  for (const TokenId t : drafts) {
    check_argument(t >= 0, "set_scheduled_drafts: a draft token id is negative");
  }
  size_t at = 0;
  for (size_t i = 0; i < num_reqs; ++i) {
    const auto d = static_cast<size_t>(buffers_.num_draft_tokens[i]);
    const auto end = static_cast<size_t>(buffers_.query_start_loc[i + 1]);
    Request* r = step_requests_[i];  // (null: removed during the step)
    for (size_t j = 0; j < d; ++j) {
      buffers_.input_ids[end - d + j] = drafts[at + j];
      if (r != nullptr) r->draft_token_ids[j] = drafts[at + j];
    }
    at += d;
  }
}

void Scheduler::retire(const Request& r, FinishReason reason) {
  if (!suffix_ || !r.params.speculate) return;
  const std::span<const TokenId> tokens(r.token_ids);
  const auto prompt = static_cast<size_t>(r.num_prompt_tokens);
  suffix_->retire(r.id,
                  reason == FinishReason::kAbort ? tokens.subspan(0, 0) : tokens.subspan(prompt));
}

int Scheduler::update(std::span<const TokenId> sampled_token_ids) {
  if (!step_pending_) throw InvalidState("update: no step was scheduled since the last update");
  const StepBuffers& b = buffers_;
  if (static_cast<int>(sampled_token_ids.size()) != b.num_sampled) {
    throw InvalidArgument("update: expected " + std::to_string(b.num_sampled) +
                          " sampled token ids (one per logits_indices row), got " +
                          std::to_string(sampled_token_ids.size()));
  }
  one_token_rows_.assign(static_cast<size_t>(b.num_reqs), 0);
  for (size_t i = 0; i < static_cast<size_t>(b.num_reqs); ++i) {
    if (b.num_draft_tokens[i] > 0) {
      throw InvalidArgument(
          "update: the step scheduled draft tokens; give each row's count of new tokens "
          "(update(tokens, num_tokens_per_row))");
    }
    one_token_rows_[i] = b.is_sampling[i];
  }
  return update(sampled_token_ids, one_token_rows_);
}

int Scheduler::update(std::span<const TokenId> tokens,
                      std::span<const int32_t> num_tokens_per_row) {
  if (!step_pending_) throw InvalidState("update: no step was scheduled since the last update");
  const StepBuffers& b = buffers_;
  const auto num_reqs = static_cast<size_t>(b.num_reqs);
  if (num_tokens_per_row.size() != num_reqs) {
    throw InvalidArgument("update: expected " + std::to_string(num_reqs) +
                          " token counts (one per row), got " +
                          std::to_string(num_tokens_per_row.size()));
  }
  size_t total = 0;
  for (size_t i = 0; i < num_reqs; ++i) {
    const int count = num_tokens_per_row[i], drafts = b.num_draft_tokens[i];
    const int least = b.is_sampling[i] != 0 ? 1 : 0, most = b.is_sampling[i] != 0 ? 1 + drafts : 0;
    if (count < least || count > most) {
      throw InvalidArgument("update: row " + std::to_string(i) + " takes " + std::to_string(least) +
                            " to " + std::to_string(most) + " new tokens, got " +
                            std::to_string(count));
    }
    const Request* r = step_requests_[i];
    for (int j = 0; r != nullptr && j + 1 < count && total + j < tokens.size(); ++j) {
      if (tokens[total + static_cast<size_t>(j)] != r->draft_token_ids[static_cast<size_t>(j)]) {
        throw InvalidArgument("update: row " + std::to_string(i) + "'s new token " +
                              std::to_string(j) + " is not its draft token there (only the " +
                              "last of a row's tokens may differ from its drafts)");
      }
    }
    total += static_cast<size_t>(count);
  }
  if (total != tokens.size()) {
    throw InvalidArgument("update: the rows' counts add up to " + std::to_string(total) +
                          " tokens, got " + std::to_string(tokens.size()));
  }
  for (const TokenId t : tokens) {
    if (t < 0) throw InvalidArgument("update: token id " + std::to_string(t) + " is negative");
  }
  step_pending_ = false;
  results_.num_reqs = b.num_reqs;
  results_.num_finished = 0;
  size_t next = 0;
  int32_t written = 0;
  for (size_t i = 0; i < num_reqs; ++i) {
    results_.token_offsets[i] = written;
    results_.new_token_ids[i] = kNoToken;
    results_.finish_reasons[i] = static_cast<uint8_t>(FinishReason::kNone);
    const auto row = tokens.subspan(next, static_cast<size_t>(num_tokens_per_row[i]));
    next += row.size();
    Request* r = step_requests_[i];
    if (r == nullptr) {  // aborted or finished by Python during the step
      results_.finish_reasons[i] = static_cast<uint8_t>(step_removed_reasons_[i]);
      continue;
    }
    if (r->num_scheduled_drafts > 0 && !row.empty()) {
      r->draft_acceptance.record(r->num_scheduled_drafts, static_cast<int>(row.size()) - 1);
    }
    const int before = r->num_tokens();
    const FinishReason reason = append_tokens(*r, row, i);
    const int appended = r->num_tokens() - before;
    written += appended;
    r->draft_token_ids.clear();
    const bool snapshot = kv_.config().state_snapshots && r->num_scheduled_drafts > 0;
    if (reason == FinishReason::kNone && snapshot && appended - 1 < r->num_scheduled_drafts) {
      // The state took the rejected drafts in: it goes back to its snapshot from before
      // the step, and the step's decode token and accepted drafts are computed again.
      kv_.restore_state(r->kv_handle);
      r->num_computed_tokens -= 1;
      kv_.rollback(r->id, r->num_computed_tokens);
    } else if (reason == FinishReason::kNone && appended > 1) {
      // The accepted drafts' KV was computed in their lookahead slots: now known tokens.
      const auto accepted = snapshot ? kv_.accept_lookahead(r->kv_handle, appended - 1)
                                     : kv_.allocate_slots(r->kv_handle, appended - 1);
      if (!accepted.has_value()) {
        throw InvalidState("update: the accepted draft tokens' slots were not held");
      }
      r->num_computed_tokens += appended - 1;
    }
    r->num_scheduled_drafts = 0;
    if (reason == FinishReason::kNone) continue;
    results_.finish_reasons[i] = static_cast<uint8_t>(reason);
    r->status = RequestStatus::kFinished;
    ++results_.num_finished;
  }
  results_.token_offsets[num_reqs] = written;
  if (results_.num_finished > 0) {
    std::erase_if(running_, [](const Request* r) { return r->status == RequestStatus::kFinished; });
    for (Request* r : step_requests_) {
      if (r != nullptr && r->status == RequestStatus::kFinished) {
        retire(*r, FinishReason::kStop);  // (any reason but an abort)
        const std::string id = r->id;     // erase destroys *r
        kv_.free(id);
        requests_.erase(id);
      }
    }
  }
  step_requests_.clear();
  return results_.num_finished;
}

void Scheduler::cancel_step() {
  if (!step_pending_) throw InvalidState("cancel_step: no step was scheduled since the last update");
  const StepBuffers& b = buffers_;
  if (!b.kv_transfers.to_host.empty() || !b.kv_transfers.to_device.empty() ||
      !b.block_copies.empty()) {
    throw InvalidState("cancel_step: the step moved KV blocks, which it may not have done");
  }
  for (const Request* r : step_requests_) {
    if (r != nullptr && r->fork_step == step_index_) {
      throw InvalidState("cancel_step: the step forked samples of request '" + r->id + "'");
    }
  }
  for (size_t i = 0; i < step_requests_.size(); ++i) {
    Request* r = step_requests_[i];
    if (r == nullptr) continue;  // (finished during the step)
    const int scheduled = b.num_scheduled_tokens[i] - b.num_draft_tokens[i];
    kv_.rollback(r->id, r->num_computed_tokens - scheduled);
    r->num_computed_tokens -= scheduled;
    r->num_scheduled_drafts = 0;
    r->draft_token_ids.clear();
  }
  results_.num_reqs = 0;
  results_.num_finished = 0;
  results_.token_offsets[0] = 0;
  step_requests_.clear();
  step_pending_ = false;
}

FinishReason Scheduler::append_tokens(Request& r, std::span<const TokenId> tokens, size_t row) {
  auto at = static_cast<size_t>(results_.token_offsets[row]);
  for (const TokenId token : tokens) {
    r.token_ids.push_back(token);
    kv_.append_token_ids(r.kv_handle, std::span<const TokenId>(&token, 1));
    results_.tokens[at++] = token;
    if (results_.new_token_ids[row] == kNoToken) results_.new_token_ids[row] = token;
    const FinishReason reason = stop_reason(r, token);
    if (reason != FinishReason::kNone) return reason;
  }
  return FinishReason::kNone;
}

SchedulerStats Scheduler::stats() const {
  SchedulerStats s;
  s.num_running = static_cast<int>(running_.size());
  s.num_waiting = static_cast<int>(waiting_.size());
  s.num_preemptions = num_preemptions_;
  s.num_swapped_preemptions = num_swapped_preemptions_;
  s.num_scheduled_prefill_tokens = last_prefill_tokens_;
  s.num_scheduled_decode_tokens = last_decode_tokens_;
  const KVCacheStats kv = kv_.stats();
  s.prefix_cache_hit_rate = kv.prefix_cache_queries == 0
                                ? 0.0
                                : static_cast<double>(kv.prefix_cache_hits) /
                                      static_cast<double>(kv.prefix_cache_queries);
  s.kv_cache_usage = kv.usage;
  s.prefix_cache_queries = kv.prefix_cache_queries;
  s.prefix_cache_hits = kv.prefix_cache_hits;
  s.prefix_cache_host_hits = kv.host_cache_hits;
  if (kv.num_host_blocks > 0) {
    s.kv_host_usage = static_cast<double>(kv.num_host_cached_blocks + kv.num_host_used_blocks) /
                      kv.num_host_blocks;
  }
  return s;
}

}  // namespace pyengine
