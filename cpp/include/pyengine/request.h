// A request as the scheduler sees it: its tokens, its limits and where it stands.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pyengine/draft_budget.h"
#include "pyengine/kv_cache_manager.h"
#include "pyengine/prefix_hash.h"

namespace pyengine {

inline constexpr TokenId kNoToken = -1;

// What ends a request and how it is ordered; the sampling itself (temperature, ...)
// is Python's.
struct RequestParams {
  int max_tokens = 16;  // generated tokens at most, >= 1
  int min_tokens = 0;   // EOS and stop tokens do not stop it before this many
  TokenId eos_token_id = kNoToken;
  std::vector<TokenId> stop_token_ids;  // the scheduler keeps its copy sorted, once each
  bool ignore_eos = false;
  int n = 1;                  // parallel samples: the prompt is computed once, then forked
  int priority = 0;           // lower runs first under the priority policy
  double arrival_time = 0.0;  // seconds; ties keep submission order
  std::string cache_salt;
  int64_t adapter_id = 0;
  bool speculate = false;  // propose_*_drafts propose to it
};

// kForkPending: sample k > 0 of a request with n > 1, waiting for its parent's prompt
// to be computed; it then shares the parent's blocks (copy-on-write) and runs.
enum class RequestStatus : uint8_t { kWaiting, kRunning, kForkPending, kFinished };

enum class FinishReason : uint8_t { kNone, kStop, kLength, kAbort };

const char* finish_reason_name(FinishReason reason);  // "", "stop", "length", "abort"

struct Request {
  std::string id;
  RequestParams params;
  std::vector<TokenId> token_ids;  // prompt, then generated tokens
  int num_prompt_tokens = 0;
  int num_computed_tokens = 0;  // tokens whose KV is computed or scheduled
  uint64_t arrival_seq = 0;     // submission order
  int num_preemptions = 0;
  int num_host_cached_tokens = 0;  // of its first step's cached prompt tokens, the host tier's
  RequestStatus status = RequestStatus::kWaiting;
  RequestHandle kv_handle;              // while the KV-cache manager holds it
  std::string parent_id;                // of sample k > 0; empty for sample 0
  int sample_index = 0;                 // k of n
  std::vector<std::string> sample_ids;  // sample 0 of n > 1: ids of samples 1..n-1
  bool forked = false;                  // sample 0: its samples have been forked
  uint64_t fork_step = 0;               // the step it was forked in (samples too)
  // Speculative decoding: tokens proposed to follow it (set_draft_tokens), and how many
  // of them the scheduled step verifies.
  std::vector<TokenId> draft_token_ids;
  int num_scheduled_drafts = 0;
  DraftAcceptance draft_acceptance;  // of its verified drafts, which sets how many

  int num_tokens() const { return static_cast<int>(token_ids.size()); }
  int num_output_tokens() const { return num_tokens() - num_prompt_tokens; }
};

}  // namespace pyengine
