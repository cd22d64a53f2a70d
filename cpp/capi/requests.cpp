#include "requests.h"

#include <chrono>
#include <string>
#include <unordered_map>

#include "bridge.h"
#include "events.h"
#include "failure.h"
#include "python_runtime.h"

namespace pyengine::capi {
namespace {

std::mutex& registry_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::unordered_map<std::int64_t, std::shared_ptr<RequestState>>& registry() {
  static std::unordered_map<std::int64_t, std::shared_ptr<RequestState>> requests;
  return requests;
}

std::shared_ptr<RequestState> find_request(std::int64_t key) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  const auto found = registry().find(key);
  return found == registry().end() ? nullptr : found->second;
}

}  // namespace

void register_request(const std::shared_ptr<RequestState>& request) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[request->key()] = request;
}

void unregister_request(std::int64_t key) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().erase(key);
}

void deliver_event(std::int64_t request, std::int32_t index, const std::int32_t* tokens,
                   std::size_t n_tokens, const char* text, std::size_t text_len,
                   const float* logprobs, const std::int32_t* top_tokens,
                   const float* top_logprobs, std::size_t top_k, std::int32_t finish,
                   std::int32_t status, std::int32_t request_finished,
                   std::int32_t prompt_tokens) {
  const std::shared_ptr<RequestState> state = find_request(request);
  if (state == nullptr) return;  // freed by its caller: nobody reads it
  OwnedEvent event;
  event.index = index;
  event.tokens.assign(tokens, tokens + n_tokens);
  event.status = static_cast<pyengine_status>(status);
  (event.status == PYENGINE_OK ? event.text : event.error).assign(text, text_len);
  if (logprobs != nullptr) {
    event.logprobs.assign(logprobs, logprobs + n_tokens);
    event.top_k = top_k;
    event.top_tokens.assign(top_tokens, top_tokens + n_tokens * top_k);
    event.top_logprobs.assign(top_logprobs, top_logprobs + n_tokens * top_k);
  }
  event.finish = static_cast<pyengine_finish_reason>(finish);
  event.request_finished = request_finished != 0;
  if (event.request_finished) unregister_request(request);
  state->deliver(std::move(event), prompt_tokens);
}

RequestState::RequestState(std::int64_t key, std::shared_ptr<EngineState> engine,
                           std::int32_t n, pyengine_event_callback callback, void* user_data)
    : key_(key),
      engine_(std::move(engine)),
      callback_(callback),
      user_data_(user_data),
      samples_(static_cast<std::size_t>(n)) {}

void RequestState::deliver(OwnedEvent event, std::int32_t prompt_tokens) {
  const bool last = event.request_finished;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (prompt_tokens > 0) prompt_tokens_ = prompt_tokens;
    if (event.index >= 0) {
      if (static_cast<std::size_t>(event.index) >= samples_.size())
        samples_.resize(static_cast<std::size_t>(event.index) + 1);
      Sample& sample = samples_[static_cast<std::size_t>(event.index)];
      sample.tokens.insert(sample.tokens.end(), event.tokens.begin(), event.tokens.end());
      sample.text += event.text;
      if (event.finish != PYENGINE_FINISH_NONE) sample.finish = event.finish;
    }
    if (event.status != PYENGINE_OK) {
      status_ = event.status;
      error_ = event.error;
      for (Sample& sample : samples_)
        if (sample.finish == PYENGINE_FINISH_NONE) sample.finish = PYENGINE_FINISH_ERROR;
    }
    if (last) {
      finished_ = true;
      ended_ = callback_ == nullptr;  // (else once its callback has seen the last event)
    }
    if (callback_ == nullptr) events_.push_back(std::move(event));
  }
  if (callback_ != nullptr) {
    engine_->post(shared_from_this(), std::move(event));
    return;
  }
  event_ready_.notify_all();
  if (last) ended_changed_.notify_all();
}

void RequestState::fill(pyengine_event* out, const OwnedEvent& event) {
  *out = pyengine_event{};
  out->request = handle_;
  out->index = event.index;
  out->tokens = event.tokens.data();
  out->n_tokens = event.tokens.size();
  out->text = event.text.c_str();
  out->text_len = event.text.size();
  if (!event.logprobs.empty()) {
    out->logprobs = event.logprobs.data();
    out->top_tokens = event.top_tokens.data();
    out->top_logprobs = event.top_logprobs.data();
    out->top_k = event.top_k;
  }
  out->finish_reason = event.finish;
  out->request_finished = event.request_finished;
  out->status = event.status;
  out->error = event.status == PYENGINE_OK ? nullptr : event.error.c_str();
}

void RequestState::run_callback(const OwnedEvent& event) {
  bool keep = true;
  {
    std::lock_guard<std::recursive_mutex> lock(callback_mutex_);
    if (!silenced_) {
      pyengine_event view;
      fill(&view, event);
      keep = callback_(&view, user_data_);
    }
  }
  if (event.request_finished) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ended_ = true;
    }
    ended_changed_.notify_all();
    return;
  }
  if (!keep) {
    try {
      abort();
    } catch (const Failure&) {  // (the engine shut down meanwhile: it aborted everything)
    }
  }
}

void RequestState::silence() {
  std::lock_guard<std::recursive_mutex> lock(callback_mutex_);
  silenced_ = true;
}

template <typename Ready>
bool RequestState::wait_for(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                            std::int32_t timeout_ms, Ready ready) {
  if (timeout_ms < 0) {
    cv.wait(lock, ready);
    return true;
  }
  return cv.wait_for(lock, std::chrono::milliseconds(timeout_ms), ready);
}

pyengine_status RequestState::next(pyengine_event* event, std::int32_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!wait_for(event_ready_, lock, timeout_ms, [&] { return !events_.empty() || finished_; }))
    return PYENGINE_TIMEOUT;
  if (events_.empty()) return PYENGINE_DONE;
  current_ = std::move(events_.front());
  events_.pop_front();
  fill(event, current_);
  return PYENGINE_OK;
}

pyengine_status RequestState::wait(std::int32_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mutex_);
  const bool ended = wait_for(ended_changed_, lock, timeout_ms, [&] { return ended_; });
  return ended ? PYENGINE_OK : PYENGINE_TIMEOUT;
}

pyengine_status RequestState::output(std::int32_t index, pyengine_output* out) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!ended_)
    fail(PYENGINE_ERROR_NOT_FINISHED, "the request is still running: wait for it first");
  if (index < 0 || static_cast<std::size_t>(index) >= samples_.size())
    fail(PYENGINE_ERROR_INVALID_ARGUMENT, "sample index " + std::to_string(index) +
                                              " is outside the request's " +
                                              std::to_string(samples_.size()) + " samples");
  const Sample& sample = samples_[static_cast<std::size_t>(index)];
  *out = pyengine_output{};
  out->tokens = sample.tokens.data();
  out->n_tokens = sample.tokens.size();
  out->text = sample.text.c_str();
  out->text_len = sample.text.size();
  out->finish_reason = sample.finish;
  out->status = status_;
  out->error = status_ == PYENGINE_OK ? nullptr : error_.c_str();
  out->prompt_tokens = prompt_tokens_;
  return PYENGINE_OK;
}

bool RequestState::finished() {
  std::lock_guard<std::mutex> lock(mutex_);
  return ended_;
}

void RequestState::abort() {
  if (finished() || engine_->closed()) return;  // (a shutdown aborted it already)
  call(engine_->key(), Op::kAbort, std::to_string(key_));
}

EngineState::~EngineState() {
  end_delivery_thread();  // (the last reference may be its own, as its loop ends)
}

void EngineState::end_delivery_thread() {
  if (!thread_.joinable()) return;
  if (on_delivery_thread())
    thread_.detach();  // (it cannot join itself; its loop ends once it returns)
  else
    thread_.join();
}

bool EngineState::closed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return closed_;
}

bool EngineState::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  return !std::exchange(closed_, true);
}

void EngineState::post(std::shared_ptr<RequestState> request, OwnedEvent event) {
  bool was_empty = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    was_empty = queue_.empty();
    queue_.emplace_back(std::move(request), std::move(event));
    if (!thread_.joinable() && !stopping_)  // (started by the first callback's event)
      thread_ = std::thread([self = shared_from_this()] { self->deliver_loop(); });
  }
  if (was_empty) queued_.notify_one();  // (the thread sleeps only on an empty queue)
}

void EngineState::deliver_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    queued_.wait(lock, [&] { return !queue_.empty() || stopping_; });
    if (queue_.empty()) return;
    auto [request, event] = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    request->run_callback(event);
    request.reset();
    lock.lock();
  }
}

void EngineState::stop_delivery() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  queued_.notify_one();
  end_delivery_thread();
}

bool EngineState::on_delivery_thread() const {
  return thread_.get_id() == std::this_thread::get_id();
}

}  // namespace pyengine::capi
