// What the scheduler tests share: a small scheduler (blocks of 4 tokens, 4 sequences,
// chunked prefill, prefix caching, FCFS) and prompts of 1, 2, ..., n.
#pragma once

#include <numeric>
#include <vector>

#include "pyengine/scheduler.h"

namespace pyengine::testing {

// Up to 4 requests, chunked prefill, FCFS.
inline SchedulerConfig scheduler_config(int budget, int max_model_len = 64) {
  SchedulerConfig config;
  config.max_num_batched_tokens = budget;
  config.max_num_seqs = 4;
  config.max_model_len = max_model_len;
  config.enable_chunked_prefill = true;
  config.long_prefill_token_threshold = 0;
  config.policy = SchedulingPolicy::kFCFS;
  return config;
}

inline Scheduler make_scheduler(int num_blocks, int budget, int max_model_len = 64) {
  return Scheduler(scheduler_config(budget, max_model_len), KVCacheConfig{num_blocks, 4, true});
}

inline std::vector<TokenId> iota_tokens(int n) {
  std::vector<TokenId> tokens(static_cast<size_t>(n));
  std::iota(tokens.begin(), tokens.end(), 1);
  return tokens;
}

}  // namespace pyengine::testing
