// Replays a stream of requests through a KVCacheManager without running a model: each
// request is added, takes its prefix hit, computes the rest of its prompt in one step,
// then decodes its given tokens one step at a time; at most max_live_requests stay
// live (the oldest is freed first), and when blocks run out the oldest live request is
// preempted. The benchmark drives the manager natively through it, as the scheduler
// will; it is also the seed of a capacity planner that runs the real memory manager
// against request traces. Internal to pyengine_core (not installed): only the bindings'
// replay_requests calls it.
#pragma once

#include <cstdint>
#include <span>

#include "pyengine/kv_cache_manager.h"

namespace pyengine {

struct ReplayRequest {
  std::span<const TokenId> prompt_token_ids;
  std::span<const TokenId> decode_token_ids;  // one per decode step
};

struct ReplayStats {
  int64_t num_ops = 0;          // manager calls made
  int64_t num_hit_tokens = 0;   // prompt tokens served from the prefix cache
  int64_t num_preemptions = 0;  // requests freed early because blocks ran out
};

// Request i gets the id "req-<i>". Throws InvalidArgument if max_live_requests < 1 and
// InvalidState if a request does not fit in an empty pool; every request is freed
// before it returns, also when it throws.
ReplayStats replay_requests(KVCacheManager& kv, std::span<const ReplayRequest> requests,
                            int max_live_requests);

}  // namespace pyengine
