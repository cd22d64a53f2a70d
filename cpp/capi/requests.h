// A submitted request's state on the C side: the events the engine thread delivers,
// queued for polling or handed to the engine's delivery thread for the callback, and
// each sample's whole output so far. The engine thread never waits on the caller: it
// only appends under a short lock.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "pyengine/pyengine_c.h"

namespace pyengine::capi {

// An event with storage of its own (pyengine_event points into it).
struct OwnedEvent {
  std::int32_t index = 0;
  std::vector<std::int32_t> tokens;
  std::string text;
  std::vector<float> logprobs;
  std::vector<std::int32_t> top_tokens;
  std::vector<float> top_logprobs;
  std::size_t top_k = 0;
  pyengine_finish_reason finish = PYENGINE_FINISH_NONE;
  bool request_finished = false;
  pyengine_status status = PYENGINE_OK;
  std::string error;  // where status is not PYENGINE_OK
};

class EngineState;

class RequestState : public std::enable_shared_from_this<RequestState> {
 public:
  RequestState(std::int64_t key, std::shared_ptr<EngineState> engine, std::int32_t n,
               pyengine_event_callback callback, void* user_data);

  std::int64_t key() const { return key_; }
  EngineState& engine() { return *engine_; }
  bool has_callback() const { return callback_ != nullptr; }
  void set_handle(pyengine_request* handle) { handle_ = handle; }

  // (the engine thread) Records the event and queues it for its reader.
  void deliver(OwnedEvent event, std::int32_t prompt_tokens);
  // (the delivery thread) Runs the callback unless the request was freed; aborts the
  // request where the callback says so.
  void run_callback(const OwnedEvent& event);
  // From here on no callback of the request runs (it waits for one running elsewhere).
  void silence();

  pyengine_status next(pyengine_event* event, std::int32_t timeout_ms);
  pyengine_status wait(std::int32_t timeout_ms);
  pyengine_status output(std::int32_t index, pyengine_output* output);
  bool finished();
  // Tells the engine to abort the request and waits until it has taken the abort.
  void abort();

 private:
  struct Sample {
    std::vector<std::int32_t> tokens;
    std::string text;
    pyengine_finish_reason finish = PYENGINE_FINISH_NONE;
  };

  // Waits on `cv` (the lock held) until `ready` or the timeout; whether `ready` holds.
  template <typename Ready>
  static bool wait_for(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                       std::int32_t timeout_ms, Ready ready);
  void fill(pyengine_event* out, const OwnedEvent& event);

  const std::int64_t key_;
  const std::shared_ptr<EngineState> engine_;
  const pyengine_event_callback callback_;
  void* const user_data_;
  pyengine_request* handle_ = nullptr;

  std::mutex mutex_;
  // Separate, so that a step's events wake only a thread polling them, never one that
  // waits for the end (each needless wake-up takes a core from the step's kernels).
  std::condition_variable event_ready_;
  std::condition_variable ended_changed_;
  std::deque<OwnedEvent> events_;  // for polling
  OwnedEvent current_;             // the event the last next() returned
  std::vector<Sample> samples_;
  bool finished_ = false;  // the engine's last event has come
  bool ended_ = false;     // ... and, with a callback, the callback has run on it
  pyengine_status status_ = PYENGINE_OK;
  std::string error_;
  std::int32_t prompt_tokens_ = 0;

  std::recursive_mutex callback_mutex_;  // held while the callback runs
  bool silenced_ = false;
};

// An engine's C side: its key in bridge.py, whether it was shut down, and the thread
// that runs callbacks, in order, off the engine thread.
class EngineState : public std::enable_shared_from_this<EngineState> {
 public:
  explicit EngineState(std::int64_t key) : key_(key) {}
  ~EngineState();

  std::int64_t key() const { return key_; }
  bool closed() const;
  // Marks the engine closed; whether it was open (the caller that closed it shuts it down).
  bool close();

  // (the engine thread) Queues an event for the delivery thread.
  void post(std::shared_ptr<RequestState> request, OwnedEvent event);
  // Runs every queued callback, then ends the delivery thread.
  void stop_delivery();
  bool on_delivery_thread() const;

 private:
  void deliver_loop();
  // Joins the delivery thread, or detaches it where this is that thread.
  void end_delivery_thread();

  const std::int64_t key_;
  mutable std::mutex mutex_;
  std::condition_variable queued_;
  std::deque<std::pair<std::shared_ptr<RequestState>, OwnedEvent>> queue_;
  std::thread thread_;
  bool closed_ = false;
  bool stopping_ = false;
};

// The requests the engine thread may deliver to, by key.
void register_request(const std::shared_ptr<RequestState>& request);
void unregister_request(std::int64_t key);

}  // namespace pyengine::capi
