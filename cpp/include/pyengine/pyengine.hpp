// pyengine's C API in C++: RAII owners of its handles (Engine, Request), exceptions for
// its errors (pyengine::Error), and a request's events as a range to iterate. Header
// only, over pyengine/pyengine_c.h: link pyengine::pyengine. C++17 or later.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pyengine/pyengine_c.h"

namespace pyengine {

// A failed call: its status and pyengine_last_error()'s text.
class Error : public std::runtime_error {
 public:
  Error(pyengine_status status, const std::string& message)
      : std::runtime_error(std::string(pyengine_status_name(status)) + ": " + message),
        status_(status) {}
  pyengine_status status() const { return status_; }

 private:
  pyengine_status status_;
};

// Throws Error where `status` is a failure; returns it otherwise (PYENGINE_TIMEOUT...).
inline pyengine_status check(pyengine_status status) {
  if (status < 0) throw Error(status, pyengine_last_error());
  return status;
}

struct Message {
  std::string role;
  std::string content;
};

// A finished sample's whole output, copied out of the request.
struct Output {
  std::vector<std::int32_t> tokens;
  std::string text;
  pyengine_finish_reason finish_reason = PYENGINE_FINISH_NONE;
};

namespace detail {
struct FreeEngine {
  void operator()(pyengine_engine* engine) const { pyengine_engine_free(engine); }
};
struct FreeRequest {
  void operator()(pyengine_request* request) const { pyengine_request_free(request); }
};

inline std::vector<pyengine_chat_message> c_messages(const std::vector<Message>& messages) {
  std::vector<pyengine_chat_message> out;
  out.reserve(messages.size());
  for (const Message& m : messages) out.push_back({m.role.c_str(), m.content.c_str()});
  return out;
}

// Calls fill(buffer, capacity, &length) until the buffer is large enough.
template <typename Item, typename Fill>
std::vector<Item> grow_into(Fill fill, std::size_t guess) {
  std::vector<Item> buffer(guess);
  std::size_t length = 0;
  pyengine_status status = fill(buffer.data(), buffer.size(), &length);
  if (status == PYENGINE_ERROR_BUFFER_TOO_SMALL) {
    buffer.resize(length + 1);
    status = fill(buffer.data(), buffer.size(), &length);
  }
  check(status);
  buffer.resize(length);
  return buffer;
}
}  // namespace detail

// One request: its events (polled, or given to the callback it was submitted with) and,
// once finished, its outputs. Destroying it aborts the request if it still runs.
class Request {
 public:
  using Callback = std::function<bool(const pyengine_event&)>;

  Request() = default;

  pyengine_request* get() const { return handle_.get(); }
  bool finished() const { return pyengine_request_finished(handle_.get()); }
  void abort() { check(pyengine_request_abort(handle_.get())); }
  // Waits for the end (timeout_ms < 0: as long as it takes); whether it has ended.
  bool wait(std::int32_t timeout_ms = -1) {
    return check(pyengine_request_wait(handle_.get(), timeout_ms)) == PYENGINE_OK;
  }

  // The next event; nullopt once the last was taken (or at the timeout). The event is
  // valid until the next call.
  std::optional<pyengine_event> next(std::int32_t timeout_ms = -1) {
    pyengine_event event{};
    if (check(pyengine_request_next(handle_.get(), &event, timeout_ms)) != PYENGINE_OK)
      return std::nullopt;
    return event;
  }

  // for (const pyengine_event& event : request.events()) { ... }: every event, in order.
  class EventIterator {
   public:
    explicit EventIterator(Request* request) : request_(request) { advance(); }
    const pyengine_event& operator*() const { return *event_; }
    const pyengine_event* operator->() const { return &*event_; }
    EventIterator& operator++() {
      advance();
      return *this;
    }
    bool operator!=(std::nullptr_t) const { return event_.has_value(); }

   private:
    void advance() { event_ = request_->next(); }
    Request* request_;
    std::optional<pyengine_event> event_;
  };
  struct Events {
    Request* request;
    EventIterator begin() const { return EventIterator(request); }
    std::nullptr_t end() const { return nullptr; }
  };
  Events events() { return Events{this}; }

  // Sample `index`'s whole output (the request must have finished: wait() first).
  Output output(std::int32_t index = 0) const {
    pyengine_output out{};
    check(pyengine_request_output(handle_.get(), index, &out));
    if (out.status != PYENGINE_OK) throw Error(out.status, out.error);
    return Output{std::vector<std::int32_t>(out.tokens, out.tokens + out.n_tokens),
                  std::string(out.text, out.text_len), out.finish_reason};
  }

 private:
  friend class Engine;
  // (the callback is freed after the request: no call can reach it once freed)
  std::unique_ptr<Callback> callback_;
  std::unique_ptr<pyengine_request, detail::FreeRequest> handle_;
};

// One engine: a model and its continuous batch. Destroying it shuts it down.
class Engine {
 public:
  // `model`: a folder, a .gguf file, a repository id in the local cache; empty: the
  // default model. `options`: EngineArgs fields by name, values as the command line
  // writes them ({"max_model_len", "2048"}, {"dtype", "float32"}).
  explicit Engine(const std::string& model = "",
                  const std::map<std::string, std::string>& options = {}) {
    std::vector<pyengine_option> c_options;
    for (const auto& [name, value] : options) c_options.push_back({name.c_str(), value.c_str()});
    pyengine_engine_params params = pyengine_engine_default_params();
    params.model = model.empty() ? nullptr : model.c_str();
    params.options = c_options.data();
    params.n_options = c_options.size();
    pyengine_engine* engine = nullptr;
    check(pyengine_engine_create(&params, &engine));
    handle_.reset(engine);
  }

  pyengine_engine* get() const { return handle_.get(); }
  void shutdown() { check(pyengine_engine_shutdown(handle_.get())); }

  pyengine_engine_info info() const {
    pyengine_engine_info out{};
    check(pyengine_engine_get_info(handle_.get(), &out));
    return out;
  }
  pyengine_stats stats() const {
    pyengine_stats out{};
    check(pyengine_engine_get_stats(handle_.get(), &out));
    return out;
  }

  std::vector<std::int32_t> tokenize(const std::string& text, bool add_special = true) const {
    return detail::grow_into<std::int32_t>(
        [&](std::int32_t* buffer, std::size_t capacity, std::size_t* length) {
          return pyengine_tokenize(handle_.get(), text.c_str(), add_special, buffer, capacity,
                                   length);
        },
        text.size() / 2 + 16);
  }
  std::string detokenize(const std::vector<std::int32_t>& tokens,
                         bool skip_special = true) const {
    auto text = detail::grow_into<char>(
        [&](char* buffer, std::size_t capacity, std::size_t* length) {
          return pyengine_detokenize(handle_.get(), tokens.data(), tokens.size(), skip_special,
                                     buffer, capacity, length);
        },
        tokens.size() * 8 + 16);
    return std::string(text.begin(), text.end());
  }
  std::string apply_chat_template(const std::vector<Message>& messages,
                                  bool add_generation_prompt = true) const {
    const auto c = detail::c_messages(messages);
    auto text = detail::grow_into<char>(
        [&](char* buffer, std::size_t capacity, std::size_t* length) {
          return pyengine_chat_apply_template(handle_.get(), c.data(), c.size(),
                                              add_generation_prompt, buffer, capacity, length);
        },
        1024);
    return std::string(text.begin(), text.end());
  }

  // Submits a request of `params` (its prompt set by the caller). With a callback, the
  // request's events go to it on the engine's delivery thread; else poll them.
  Request submit(pyengine_request_params params, Request::Callback callback = nullptr) {
    Request request;
    if (callback) {
      request.callback_ = std::make_unique<Request::Callback>(std::move(callback));
      params.callback = [](const pyengine_event* event, void* user_data) {
        return (*static_cast<Request::Callback*>(user_data))(*event);
      };
      params.user_data = request.callback_.get();
    }
    pyengine_request* handle = nullptr;
    check(pyengine_submit(handle_.get(), &params, &handle));
    request.handle_.reset(handle);
    return request;
  }
  Request submit(const std::string& prompt, const pyengine_sampling_params& sampling,
                 Request::Callback callback = nullptr) {
    pyengine_request_params params = pyengine_request_default_params();
    params.prompt = prompt.c_str();
    params.sampling = sampling;
    return submit(params, std::move(callback));
  }
  Request submit(const std::vector<Message>& messages, const pyengine_sampling_params& sampling,
                 Request::Callback callback = nullptr) {
    const auto c = detail::c_messages(messages);
    pyengine_request_params params = pyengine_request_default_params();
    params.messages = c.data();
    params.n_messages = c.size();
    params.sampling = sampling;
    return submit(params, std::move(callback));
  }

  // The texts' embeddings (a pooling model), one row each.
  std::vector<std::vector<float>> embed(const std::vector<std::string>& texts,
                                        pyengine_embed_params params =
                                            pyengine_embed_default_params()) const {
    std::vector<const char*> c;
    for (const std::string& t : texts) c.push_back(t.c_str());
    const std::size_t width = static_cast<std::size_t>(info().embedding_size);
    std::vector<float> flat(texts.size() * width);
    std::size_t dimension = 0;
    check(pyengine_embed(handle_.get(), c.data(), c.size(), &params, flat.data(), flat.size(),
                         &dimension));
    std::vector<std::vector<float>> rows;
    for (std::size_t i = 0; i < texts.size(); ++i)
      rows.emplace_back(flat.begin() + i * dimension, flat.begin() + (i + 1) * dimension);
    return rows;
  }

 private:
  std::unique_ptr<pyengine_engine, detail::FreeEngine> handle_;
};

}  // namespace pyengine
