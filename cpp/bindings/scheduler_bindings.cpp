#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "pyengine/draft_budget.h"
#include "pyengine/errors.h"
#include "pyengine/scheduler.h"
#include "token_ids.h"

namespace py = pybind11;

namespace pyengine::bindings {
namespace {

// A numpy view of `data` (no copy) that keeps `owner` alive.
template <typename T>
py::array view(const std::vector<T>& data, std::vector<py::ssize_t> shape, py::handle owner) {
  return py::array_t<T>(std::move(shape), data.data(), owner);
}

// A view of every KV-cache group's leading `shape` of arrays `group_stride` apart.
template <typename T>
py::array group_view(const std::vector<T>& data, int num_groups, py::ssize_t group_stride,
                     std::vector<py::ssize_t> shape, py::handle owner) {
  std::vector<py::ssize_t> strides(shape.size(), static_cast<py::ssize_t>(sizeof(T)));
  for (size_t i = shape.size(); i-- > 1;) strides[i - 1] = strides[i] * shape[i];
  shape.insert(shape.begin(), num_groups);
  strides.insert(strides.begin(), group_stride * static_cast<py::ssize_t>(sizeof(T)));
  return py::array_t<T>(std::move(shape), std::move(strides), data.data(), owner);
}

SchedulingPolicy parse_policy(const std::string& name) {
  if (name == "fcfs") return SchedulingPolicy::kFCFS;
  if (name == "priority") return SchedulingPolicy::kPriority;
  throw py::value_error("policy must be 'fcfs' or 'priority', got '" + name + "'");
}

PreemptionMode parse_preemption_mode(const std::string& name) {
  if (name == "recompute") return PreemptionMode::kRecompute;
  if (name == "swap") return PreemptionMode::kSwap;
  throw py::value_error("preemption_mode must be 'recompute' or 'swap', got '" + name + "'");
}

FinishReason parse_reason(const std::string& name) {
  if (name == "stop") return FinishReason::kStop;
  if (name == "length") return FinishReason::kLength;
  if (name == "abort") return FinishReason::kAbort;
  throw py::value_error("finish reason must be 'stop', 'length' or 'abort', got '" + name + "'");
}

py::object reason_or_none(uint8_t code) {
  const auto reason = static_cast<FinishReason>(code);
  if (reason == FinishReason::kNone) return py::none();
  return py::str(finish_reason_name(reason));
}

void bind_step_buffers(py::module_& m) {
  py::class_<StepBuffers>(m, "StepBuffers", R"doc(The flat inputs of the scheduled step.

Arrays are numpy views of the scheduler's buffers, sized to this step; the next
schedule() overwrites them. Rows of block_tables past a request's blocks are stale.
slot_mapping and block_tables are KV-cache group 0's; group_slot_mapping and
group_block_tables hold every group's.)doc")
      .def_readonly("num_reqs", &StepBuffers::num_reqs)
      .def_readonly("num_tokens", &StepBuffers::num_tokens)
      .def_readonly("num_sampled", &StepBuffers::num_sampled)
      .def_readonly("max_blocks_per_request", &StepBuffers::max_blocks_per_request)
      .def_readonly("num_kv_groups", &StepBuffers::num_kv_groups)
      .def_property_readonly(
          "group_slot_mapping",
          [](py::object self) {
            const auto& b = self.cast<const StepBuffers&>();
            return group_view(b.slot_mapping, b.num_kv_groups, b.max_num_batched_tokens,
                              {b.num_tokens}, self);
          },
          "Every KV-cache group's slot_mapping, [num_kv_groups, num_tokens].")
      .def_property_readonly(
          "group_block_tables",
          [](py::object self) {
            const auto& b = self.cast<const StepBuffers&>();
            return group_view(b.block_tables, b.num_kv_groups,
                              static_cast<py::ssize_t>(b.max_num_seqs) * b.max_blocks_per_request,
                              {b.num_reqs, b.max_blocks_per_request}, self);
          },
          "Every KV-cache group's block_tables, [num_kv_groups, num_reqs, max_blocks].")
      .def_property_readonly("input_ids",
                             [](py::object self) {
                               const auto& b = self.cast<const StepBuffers&>();
                               return view(b.input_ids, {b.num_tokens}, self);
                             })
      .def_property_readonly("positions",
                             [](py::object self) {
                               const auto& b = self.cast<const StepBuffers&>();
                               return view(b.positions, {b.num_tokens}, self);
                             })
      .def_property_readonly("slot_mapping",
                             [](py::object self) {
                               const auto& b = self.cast<const StepBuffers&>();
                               return view(b.slot_mapping, {b.num_tokens}, self);
                             })
      .def_property_readonly("query_start_loc",
                             [](py::object self) {
                               const auto& b = self.cast<const StepBuffers&>();
                               return view(b.query_start_loc, {b.num_reqs + 1}, self);
                             })
      .def_property_readonly("seq_lens",
                             [](py::object self) {
                               const auto& b = self.cast<const StepBuffers&>();
                               return view(b.seq_lens, {b.num_reqs}, self);
                             })
      .def_property_readonly(
          "block_tables",
          [](py::object self) {
            const auto& b = self.cast<const StepBuffers&>();
            return view(b.block_tables, {b.num_reqs, b.max_blocks_per_request}, self);
          })
      .def_property_readonly("logits_indices",
                             [](py::object self) {
                               const auto& b = self.cast<const StepBuffers&>();
                               return view(b.logits_indices, {b.num_sampled}, self);
                             })
      .def_property_readonly("num_scheduled_tokens",
                             [](py::object self) {
                               const auto& b = self.cast<const StepBuffers&>();
                               return view(b.num_scheduled_tokens, {b.num_reqs}, self);
                             })
      .def_property_readonly("is_sampling",
                             [](py::object self) {
                               const auto& b = self.cast<const StepBuffers&>();
                               return view(b.is_sampling, {b.num_reqs}, self).attr("view")("bool");
                             })
      .def_property_readonly("num_draft_tokens",
                             [](py::object self) {
                               const auto& b = self.cast<const StepBuffers&>();
                               return view(b.num_draft_tokens, {b.num_reqs}, self);
                             })
      .def_property_readonly(
          "state_slots",
          [](py::object self) {
            const auto& b = self.cast<const StepBuffers&>();
            return view(b.state_slots, {b.num_reqs}, self);
          },
          "Each request's recurrent-state slot (-1 without states).")
      .def_property_readonly(
          "has_state",
          [](py::object self) {
            const auto& b = self.cast<const StepBuffers&>();
            return view(b.has_state, {b.num_reqs}, self);
          },
          "1 where the request's slot holds the state of its tokens before the step, 0 where "
          "it is new (read as zeros).")
      .def_readonly("request_ids", &StepBuffers::request_ids)
      .def_property_readonly(
          "kv_to_host", [](const StepBuffers& b) { return b.kv_transfers.to_host; },
          "(device block, host block) copies, run first.")
      .def_property_readonly(
          "kv_to_device", [](const StepBuffers& b) { return b.kv_transfers.to_device; },
          "(host block, device block) copies, run after kv_to_host.")
      .def_readonly("block_copies", &StepBuffers::block_copies)
      .def_readonly("state_loads", &StepBuffers::state_loads,
                    "(src, dst) state-slot copies to run before the step's forward pass (a "
                    "prefix hit's state, from its checkpoint).")
      .def_readonly("state_copies", &StepBuffers::state_copies,
                    "(src, dst) state-slot copies to run after the step's forward pass "
                    "(samples forked in it start from their parent's state).");
}

void bind_step_results(py::module_& m) {
  py::class_<StepResults>(m, "StepResults",
                          "What update() reported, row by row as in StepBuffers.request_ids.")
      .def_readonly("num_reqs", &StepResults::num_reqs)
      .def_readonly("num_finished", &StepResults::num_finished)
      .def_property_readonly("new_token_ids",
                             [](py::object self) {
                               const auto& r = self.cast<const StepResults&>();
                               return view(r.new_token_ids, {r.num_reqs}, self);
                             })
      .def_property_readonly("finish_reasons",
                             [](py::object self) {
                               const auto& r = self.cast<const StepResults&>();
                               return view(r.finish_reasons, {r.num_reqs}, self);
                             })
      .def_property_readonly("token_offsets",
                             [](py::object self) {
                               const auto& r = self.cast<const StepResults&>();
                               return view(r.token_offsets, {r.num_reqs + 1}, self);
                             })
      .def_property_readonly("tokens", [](py::object self) {
        const auto& r = self.cast<const StepResults&>();
        return view(r.tokens, {r.token_offsets[static_cast<size_t>(r.num_reqs)]}, self);
      });
}

void bind_stats(py::module_& m) {
  py::class_<SchedulerStats>(m, "SchedulerStats")
      .def_readonly("num_running", &SchedulerStats::num_running)
      .def_readonly("num_waiting", &SchedulerStats::num_waiting)
      .def_readonly("num_preemptions", &SchedulerStats::num_preemptions)
      .def_readonly("num_swapped_preemptions", &SchedulerStats::num_swapped_preemptions)
      .def_readonly("num_scheduled_prefill_tokens", &SchedulerStats::num_scheduled_prefill_tokens)
      .def_readonly("num_scheduled_decode_tokens", &SchedulerStats::num_scheduled_decode_tokens)
      .def_readonly("prefix_cache_hit_rate", &SchedulerStats::prefix_cache_hit_rate)
      .def_readonly("kv_cache_usage", &SchedulerStats::kv_cache_usage)
      .def_readonly("prefix_cache_queries", &SchedulerStats::prefix_cache_queries)
      .def_readonly("prefix_cache_hits", &SchedulerStats::prefix_cache_hits)
      .def_readonly("prefix_cache_host_hits", &SchedulerStats::prefix_cache_host_hits)
      .def_readonly("kv_host_usage", &SchedulerStats::kv_host_usage);
}

void bind_scheduler_class(py::module_& m) {
  py::class_<Scheduler>(m, "Scheduler", R"doc(Continuous-batching scheduler over a paged KV cache.

Each step: n = schedule(); run the model on `buffers`; sample one token per
buffers.logits_indices row; update(sampled). See cpp/include/pyengine/scheduler.h.)doc")
      .def(py::init([](int num_blocks, int block_size, bool enable_prefix_caching,
                       int max_num_batched_tokens, int max_num_seqs, int max_model_len,
                       bool enable_chunked_prefill, int long_prefill_token_threshold,
                       const std::string& policy, int max_loras, double draft_row_cost,
                       int num_host_blocks, const std::string& preemption_mode,
                       const std::vector<std::pair<std::string, int>>& groups,
                       int num_state_slots, int num_state_checkpoints,
                       int state_checkpoint_interval, bool state_snapshots) {
             SchedulerConfig config;
             config.max_num_batched_tokens = max_num_batched_tokens;
             config.max_num_seqs = max_num_seqs;
             config.max_model_len = max_model_len;
             config.enable_chunked_prefill = enable_chunked_prefill;
             config.long_prefill_token_threshold = long_prefill_token_threshold;
             config.policy = parse_policy(policy);
             config.max_loras = max_loras;
             config.draft_row_cost = draft_row_cost;
             config.preemption_mode = parse_preemption_mode(preemption_mode);
             return std::make_unique<Scheduler>(
                 config, KVCacheConfig{num_blocks, block_size, enable_prefix_caching,
                                       num_host_blocks, kv_groups(groups), num_state_slots,
                                       num_state_checkpoints, state_checkpoint_interval,
                                       state_snapshots});
           }),
           // No defaults: the engine's live in Python's EngineArgs alone.
           py::arg("num_blocks"), py::arg("block_size"), py::arg("enable_prefix_caching"),
           py::arg("max_num_batched_tokens"), py::arg("max_num_seqs"), py::arg("max_model_len"),
           py::arg("enable_chunked_prefill"), py::arg("long_prefill_token_threshold"),
           // (but max_loras: 0, no adapter budget, where a tool schedules without LoRA;
           // draft_row_cost: 0, every draft that fits)
           // num_host_blocks: 0, no host tier, and recompute preemption
           py::arg("policy"), py::arg("max_loras") = 0, py::arg("draft_row_cost") = 0.0,
           py::arg("num_host_blocks") = 0, py::arg("preemption_mode") = "recompute",
           // kv_groups: one full-attention group
           py::arg("kv_groups") = std::vector<std::pair<std::string, int>>{},
           // num_state_slots: 0, no recurrent states; num_state_checkpoints: 0, none;
           // state_checkpoint_interval: checkpoints every block; state_snapshots: none
           py::arg("num_state_slots") = 0, py::arg("num_state_checkpoints") = 0,
           py::arg("state_checkpoint_interval") = 1, py::arg("state_snapshots") = false)
      .def(
          "add_request",
          [](Scheduler& s, const std::string& id, const py::handle& prompt, int max_tokens,
             int min_tokens, std::optional<TokenId> eos_token_id,
             const std::vector<TokenId>& stop_token_ids, bool ignore_eos, int n, int priority,
             double arrival_time, std::string cache_salt, int64_t adapter_id, bool speculate) {
            const TokenIds tokens(prompt, "prompt_token_ids");
            RequestParams params;
            params.max_tokens = max_tokens;
            params.min_tokens = min_tokens;
            params.eos_token_id = eos_token_id.value_or(kNoToken);
            if (eos_token_id && *eos_token_id < 0) {
              throw py::value_error("add_request: eos_token_id must be non-negative");
            }
            params.stop_token_ids = stop_token_ids;
            params.ignore_eos = ignore_eos;
            params.n = n;
            params.priority = priority;
            params.arrival_time = arrival_time;
            params.cache_salt = std::move(cache_salt);
            params.adapter_id = adapter_id;
            params.speculate = speculate;
            s.add_request(id, tokens.span(), params);
          },
          py::arg("request_id"), py::arg("prompt_token_ids"), py::arg("max_tokens") = 16,
          py::arg("min_tokens") = 0, py::arg("eos_token_id") = py::none(),
          py::arg("stop_token_ids") = std::vector<TokenId>{}, py::arg("ignore_eos") = false,
          py::arg("n") = 1, py::arg("priority") = 0, py::arg("arrival_time") = 0.0,
          py::arg("cache_salt") = "", py::arg("adapter_id") = 0, py::arg("speculate") = false)
      .def("abort_request", &Scheduler::abort_request, py::arg("request_id"))
      .def(
          "finish_request",
          [](Scheduler& s, const std::string& id, const std::string& reason) {
            s.finish_request(id, parse_reason(reason));
          },
          py::arg("request_id"), py::arg("finish_reason"))
      .def("schedule", &Scheduler::schedule, "Plans one step; returns the number of requests.")
      .def_property_readonly("buffers", &Scheduler::buffers,
                             py::return_value_policy::reference_internal)
      .def(
          "update",
          [](Scheduler& s, const py::handle& sampled, const py::handle& counts) {
            const TokenIds tokens(sampled, "sampled_token_ids");
            if (counts.is_none()) return s.update(tokens.span());
            const TokenIds per_row(counts, "num_tokens_per_row");
            return s.update(tokens.span(), per_row.span());
          },
          py::arg("sampled_token_ids"), py::arg("num_tokens_per_row") = py::none(),
          "Applies the step's sampled tokens (one per logits row; or, with "
          "num_tokens_per_row, each row's accepted drafts and one token more); returns how "
          "many requests finished.")
      .def("cancel_step", &Scheduler::cancel_step,
           "Ends the scheduled step as if it had not run: its rows left are scheduled again "
           "later (RuntimeError, changing nothing, where it forked samples or moved KV "
           "blocks).")
      .def(
          "set_draft_tokens",
          [](Scheduler& s, const std::string& id, const py::handle& drafts) {
            const TokenIds tokens(drafts, "draft_token_ids");
            s.set_draft_tokens(id, tokens.span());
          },
          py::arg("request_id"), py::arg("draft_token_ids"),
          "Proposes tokens to follow a request's (speculative decoding) for the next step.")
      .def(
          "propose_ngram_drafts",
          [](Scheduler& s, int min_n, int max_n, int max_draft) {
            return s.propose_ngram_drafts(NgramConfig{min_n, max_n, max_draft});
          },
          py::arg("prompt_lookup_min"), py::arg("prompt_lookup_max"),
          py::arg("num_speculative_tokens"),
          "Proposes prompt-lookup drafts to every decoding request; returns how many got one.")
      .def(
          "enable_suffix_drafts",
          [](Scheduler& s, int max_tree_depth, int max_cached_requests, double max_spec_factor,
             double min_token_prob, int max_draft) {
            s.enable_suffix_drafts(SuffixConfig{max_tree_depth, max_cached_requests,
                                                max_spec_factor, min_token_prob, max_draft});
          },
          py::arg("max_tree_depth"), py::arg("max_cached_requests"), py::arg("max_spec_factor"),
          py::arg("min_token_prob"), py::arg("num_speculative_tokens"),
          "Suffix decoding: a suffix tree per request and one of earlier requests' outputs.")
      .def("reset_suffix_cache", &Scheduler::reset_suffix_cache,
           "Forgets the earlier requests' outputs suffix decoding holds.")
      .def("reserve_draft_tokens", &Scheduler::reserve_draft_tokens,
           py::arg("num_speculative_tokens"),
           "Placeholder drafts for every decoding request, their tokens the step's own "
           "(a draft model's): set_scheduled_drafts gives them before update.")
      .def(
          "set_scheduled_drafts",
          [](Scheduler& s, const py::handle& drafts) {
            const TokenIds tokens(drafts, "draft_token_ids");
            s.set_scheduled_drafts(tokens.span());
          },
          py::arg("draft_token_ids"),
          "The tokens of the scheduled step's drafts, row after row.")
      .def("propose_suffix_drafts", &Scheduler::propose_suffix_drafts,
           "Proposes suffix-tree drafts to every decoding request; returns how many got one.")
      .def(
          "suffix_tree_sizes",
          [](const Scheduler& s) {
            const SuffixProposer* p = s.suffix_proposer();
            if (p == nullptr) throw InvalidState("suffix_tree_sizes: suffix decoding is off");
            return py::dict(py::arg("request_trees") = p->num_request_trees(),
                            py::arg("cached_outputs") = p->num_cached_outputs(),
                            py::arg("global_nodes") = p->num_global_nodes());
          },
          "The suffix proposer's trees: per-request ones, cached outputs, global nodes.")
      .def_property_readonly("results", &Scheduler::results,
                             py::return_value_policy::reference_internal)
      .def(
          "outputs",
          [](const Scheduler& s) {
            const StepBuffers& b = s.buffers();
            const StepResults& r = s.results();
            py::list out;
            for (size_t i = 0; i < static_cast<size_t>(r.num_reqs); ++i) {
              const auto first = static_cast<size_t>(r.token_offsets[i]);
              const auto end = static_cast<size_t>(r.token_offsets[i + 1]);
              const uint8_t reason = r.finish_reasons[i];
              for (size_t t = first; t + 1 < end; ++t) {  // accepted drafts: no reason yet
                out.append(py::make_tuple(b.request_ids[i], r.tokens[t], py::none()));
              }
              if (first == end && reason == 0) continue;
              out.append(py::make_tuple(
                  b.request_ids[i],
                  first == end ? py::object(py::none()) : py::int_(r.tokens[end - 1]),
                  reason_or_none(reason)));
            }
            return out;
          },
          "(request_id, new_token_id or None, finish_reason or None) of the last update(), "
          "one per new token (a row's accepted drafts, then its last token with the reason).")
      .def("has_request", &Scheduler::has_request, py::arg("request_id"))
      .def("has_unfinished_requests", &Scheduler::has_unfinished_requests)
      .def(
          "token_ids",
          [](const Scheduler& s, const std::string& id) { return s.request(id).token_ids; },
          py::arg("request_id"), "Prompt then generated tokens of an unfinished request.")
      .def(
          "status",
          [](const Scheduler& s, const std::string& id) {
            switch (s.request(id).status) {
              case RequestStatus::kWaiting: return "waiting";
              case RequestStatus::kRunning: return "running";
              case RequestStatus::kForkPending: return "fork_pending";
              case RequestStatus::kFinished: break;
            }
            return "finished";
          },
          py::arg("request_id"),
          "'waiting', 'running' or 'fork_pending' (a sample waiting for its prompt).")
      .def_static("sample_id", &Scheduler::sample_id, py::arg("request_id"), py::arg("k"),
                  "The id of sample k (1 <= k < n) of a request added with n > 1.")
      .def(
          "num_computed_tokens",
          [](const Scheduler& s, const std::string& id) {
            return s.request(id).num_computed_tokens;
          },
          py::arg("request_id"))
      .def(
          "num_host_cached_tokens",
          [](const Scheduler& s, const std::string& id) {
            return s.request(id).num_host_cached_tokens;
          },
          py::arg("request_id"),
          "Of the prompt tokens its first step found cached, those the host tier held.")
      .def("stats", &Scheduler::stats)
      .def_property_readonly("kv_cache", &Scheduler::kv_cache,
                             py::return_value_policy::reference_internal);
}

}  // namespace

void bind_scheduler(py::module_& m) {
  bind_step_buffers(m);
  bind_step_results(m);
  m.def(
      "propose_ngram",
      [](const py::handle& tokens, int min_n, int max_n, int max_draft) {
        const TokenIds ids(tokens, "token_ids");
        return propose_ngram(ids.span(), NgramConfig{min_n, max_n, max_draft});
      },
      py::arg("token_ids"), py::arg("prompt_lookup_min"), py::arg("prompt_lookup_max"),
      py::arg("num_speculative_tokens"),
      "Prompt lookup: the tokens that followed the most recent earlier occurrence of the "
      "longest suffix (prompt_lookup_max down to prompt_lookup_min tokens) of token_ids.");
  m.def("draft_budget", &draft_budget, py::arg("rate"), py::arg("available"), py::arg("row_cost"),
        "How many of `available` drafts a request verifies at an acceptance `rate`, where "
        "a token row costs row_cost of a one-token step (see draft_budget.h).");
  bind_stats(m);
  bind_scheduler_class(m);
}

}  // namespace pyengine::bindings
