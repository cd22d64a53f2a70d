#include "request_replay.h"

#include <deque>
#include <string>

#include "pyengine/errors.h"

namespace pyengine {
namespace {

class Replay {
 public:
  Replay(KVCacheManager& kv, int max_live_requests) : kv_(kv), max_live_(max_live_requests) {}
  ~Replay() {
    for (const RequestId& id : live_) kv_.free(id);
  }
  Replay(const Replay&) = delete;
  Replay& operator=(const Replay&) = delete;

  void run(const ReplayRequest& request, const RequestId& id) {
    kv_.add_request(id, request.prompt_token_ids);
    live_.push_back(id);
    ComputedBlocks hit = kv_.get_computed_blocks(id);
    stats_.num_ops += 2;
    stats_.num_hit_tokens += hit.num_computed_tokens;
    const auto prompt_length = static_cast<int>(request.prompt_token_ids.size());
    allocate(id, prompt_length - hit.num_computed_tokens, &hit);
    for (size_t i = 0; i < request.decode_token_ids.size(); ++i) {
      kv_.append_token_ids(id, request.decode_token_ids.subspan(i, 1));
      ++stats_.num_ops;
      allocate(id, 1, nullptr);
    }
    if (static_cast<int>(live_.size()) > max_live_) free_oldest();
  }

  ReplayStats finish() {
    while (!live_.empty()) free_oldest();
    return stats_;
  }

 private:
  void allocate(const RequestId& id, int num_new_tokens, const ComputedBlocks* hit) {
    while (true) {
      const bool done = kv_.allocate_slots(id, num_new_tokens, 0, hit).has_value();
      ++stats_.num_ops;
      if (done) return;
      // Preempt the oldest other request. A pending hit stays valid: free() evicts nothing.
      if (live_.front() == id) throw InvalidState("replay_requests: " + id + " does not fit");
      free_oldest();
      ++stats_.num_preemptions;
    }
  }

  void free_oldest() {
    kv_.free(live_.front());
    live_.pop_front();
    ++stats_.num_ops;
  }

  KVCacheManager& kv_;
  int max_live_;
  std::deque<RequestId> live_;  // oldest first; the request being run is last
  ReplayStats stats_;
};

}  // namespace

ReplayStats replay_requests(KVCacheManager& kv, std::span<const ReplayRequest> requests,
                            int max_live_requests) {
  check_argument(max_live_requests >= 1, "replay_requests: max_live_requests must be positive");
  Replay replay(kv, max_live_requests);
  for (size_t i = 0; i < requests.size(); ++i) {
    replay.run(requests[i], "req-" + std::to_string(i));
  }
  return replay.finish();
}

}  // namespace pyengine
