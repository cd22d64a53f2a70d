// The C API's entry points (pyengine/pyengine_c.h): each checks its arguments, turns the
// call into an operation of bridge.py's (JSON in, bytes out), and maps any failure to a
// status and this thread's last error. No C++ lock is held while Python runs.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include "bridge.h"
#include "failure.h"
#include "json_writer.h"
#include "pyengine/pyengine_c.h"
#include "pyengine/version.h"
#include "python_runtime.h"
#include "requests.h"

using pyengine::capi::EngineState;
using pyengine::capi::Failure;
using pyengine::capi::JsonWriter;
using pyengine::capi::Op;
using pyengine::capi::RequestState;
using pyengine::capi::call;
using pyengine::capi::fail;
using pyengine::capi::require;

struct pyengine_engine {
  std::shared_ptr<EngineState> state;
};

struct pyengine_request {
  std::shared_ptr<RequestState> state;
};

namespace {

thread_local std::string last_error;

template <typename Body>
pyengine_status guarded(Body body) noexcept {
  try {
    return body();
  } catch (const Failure& failure) {
    last_error = failure.what();
    return failure.status();
  } catch (const std::bad_alloc&) {
    last_error = "out of memory";
  } catch (const std::exception& error) {
    last_error = std::string("internal error: ") + error.what();
  } catch (...) {
    last_error = "internal error: an unknown exception";
  }
  return PYENGINE_ERROR_INTERNAL;
}

EngineState& open_engine(pyengine_engine* engine) {
  require(engine != nullptr, "engine is NULL");
  if (engine->state->closed()) fail(PYENGINE_ERROR_CLOSED, "the engine has been shut down");
  return *engine->state;
}

// The engines not yet shut down, which the process's exit shuts down (their loops and
// workers end before the libraries under them unload).
class LiveEngines {
 public:
  void add(const std::shared_ptr<EngineState>& engine) {
    std::call_once(registered_, [] { std::atexit(&LiveEngines::shutdown_at_exit); });
    std::lock_guard<std::mutex> lock(mutex_);
    std::erase_if(engines_, [](const auto& e) { return e.expired(); });
    engines_.push_back(engine);
  }

  static LiveEngines& instance() {
    static LiveEngines engines;
    return engines;
  }

 private:
  static void shutdown_at_exit() {
    std::vector<std::weak_ptr<EngineState>> engines;
    {
      std::lock_guard<std::mutex> lock(instance().mutex_);
      engines.swap(instance().engines_);
    }
    for (const auto& weak : engines) {
      pyengine_engine handle{weak.lock()};
      if (handle.state != nullptr) pyengine_engine_shutdown(&handle);
    }
  }

  std::once_flag registered_;
  std::mutex mutex_;
  std::vector<std::weak_ptr<EngineState>> engines_;
};

// Copies `bytes` (whole items of `Item`) to a caller's buffer of `capacity` items;
// *length gets the count, and a text buffer its NUL where there is room.
template <typename Item>
pyengine_status copy_out(const std::string& bytes, Item* buffer, std::size_t capacity,
                         std::size_t* length) {
  const std::size_t count = bytes.size() / sizeof(Item);
  *length = count;
  if (capacity < count) {
    last_error = "the buffer holds " + std::to_string(capacity) + ", the result needs " +
                 std::to_string(count) + " (written to *length)";
    return PYENGINE_ERROR_BUFFER_TOO_SMALL;
  }
  if (count > 0) std::memcpy(buffer, bytes.data(), count * sizeof(Item));
  if constexpr (std::is_same_v<Item, char>) {
    if (capacity > count) buffer[count] = '\0';
  }
  return PYENGINE_OK;
}

void write_messages(JsonWriter& json, const pyengine_chat_message* messages, std::size_t n) {
  require(n == 0 || messages != nullptr, "messages is NULL but n_messages is not 0");
  json.begin_array();
  for (std::size_t i = 0; i < n; ++i) {
    require(messages[i].role != nullptr && messages[i].content != nullptr,
            "a chat message's role or content is NULL");
    json.begin_object().key("role").value(messages[i].role);
    json.key("content").value(messages[i].content).end_object();
  }
  json.end_array();
}

void write_sampling(JsonWriter& json, const pyengine_sampling_params& s) {
  require(s.n_stop == 0 || s.stop != nullptr, "sampling.stop is NULL but n_stop is not 0");
  require(s.n_stop_token_ids == 0 || s.stop_token_ids != nullptr,
          "sampling.stop_token_ids is NULL but n_stop_token_ids is not 0");
  json.begin_object();
  json.key("n").value(s.n);
  json.key("max_tokens");
  s.max_tokens == -1 ? json.null() : json.value(s.max_tokens);
  json.key("min_tokens").value(s.min_tokens);
  json.key("temperature").value(static_cast<double>(s.temperature));
  json.key("top_p").value(static_cast<double>(s.top_p));
  json.key("top_k").value(s.top_k);
  json.key("min_p").value(static_cast<double>(s.min_p));
  json.key("presence_penalty").value(static_cast<double>(s.presence_penalty));
  json.key("frequency_penalty").value(static_cast<double>(s.frequency_penalty));
  json.key("repetition_penalty").value(static_cast<double>(s.repetition_penalty));
  json.key("seed");
  s.seed == -1 ? json.null() : json.value(s.seed);
  json.key("stop").begin_array();
  for (std::size_t i = 0; i < s.n_stop; ++i) {
    require(s.stop[i] != nullptr, "a sampling.stop string is NULL");
    json.value(s.stop[i]);
  }
  json.end_array();
  json.key("stop_token_ids").begin_array();
  for (std::size_t i = 0; i < s.n_stop_token_ids; ++i) json.value(s.stop_token_ids[i]);
  json.end_array();
  json.key("ignore_eos").value(s.ignore_eos);
  json.key("skip_special_tokens").value(s.skip_special_tokens);
  json.key("logprobs");
  s.logprobs == -1 ? json.null() : json.value(s.logprobs);
  json.key("structured_outputs").begin_object();
  if (s.json_schema != nullptr) json.key("json").value(s.json_schema);
  if (s.regex != nullptr) json.key("regex").value(s.regex);
  if (s.grammar != nullptr) json.key("grammar").value(s.grammar);
  if (s.json_object) json.key("json_object").value(true);
  json.end_object();
  json.end_object();
}

std::string request_json(std::int64_t key, const pyengine_request_params& p) {
  const bool has_text = p.prompt != nullptr;
  const bool has_tokens = p.prompt_tokens != nullptr || p.n_prompt_tokens != 0;
  const bool has_messages = p.messages != nullptr || p.n_messages != 0;
  require(has_text + has_tokens + has_messages == 1,
          "a request needs exactly one prompt: prompt, prompt_tokens or messages");
  require(!has_tokens || (p.prompt_tokens != nullptr && p.n_prompt_tokens > 0),
          "prompt_tokens is NULL or n_prompt_tokens is 0");
  require(!has_messages || (p.messages != nullptr && p.n_messages > 0),
          "messages is NULL or n_messages is 0");
  JsonWriter json;
  json.begin_object().key("request").value(key);
  if (has_text) json.key("prompt").value(p.prompt);
  if (has_tokens) {
    json.key("prompt_token_ids").begin_array();
    for (std::size_t i = 0; i < p.n_prompt_tokens; ++i) json.value(p.prompt_tokens[i]);
    json.end_array();
  }
  if (has_messages) write_messages(json.key("messages"), p.messages, p.n_messages);
  write_sampling(json.key("sampling"), p.sampling);
  json.key("extra").value(p.sampling.extra_json);  // (parsed by bridge.py, which names it)
  json.key("lora");
  if (p.lora == nullptr) {
    json.null();
  } else {
    require(p.lora->name != nullptr && p.lora->path != nullptr, "lora's name or path is NULL");
    json.begin_object().key("name").value(p.lora->name).key("id").value(p.lora->id);
    json.key("path").value(p.lora->path).end_object();
  }
  json.key("priority").value(p.priority).key("stream").value(p.callback != nullptr);
  return json.end_object().text();
}

std::atomic<std::int64_t> next_request_key{1};

}  // namespace

extern "C" {

const char* pyengine_version(void) { return PYENGINE_VERSION; }

int32_t pyengine_abi_version(void) { return PYENGINE_ABI_VERSION; }

const char* pyengine_last_error(void) { return last_error.c_str(); }

const char* pyengine_status_name(pyengine_status status) {
  switch (status) {
    case PYENGINE_OK: return "PYENGINE_OK";
    case PYENGINE_TIMEOUT: return "PYENGINE_TIMEOUT";
    case PYENGINE_DONE: return "PYENGINE_DONE";
    case PYENGINE_ERROR_INVALID_ARGUMENT: return "PYENGINE_ERROR_INVALID_ARGUMENT";
    case PYENGINE_ERROR_ENVIRONMENT: return "PYENGINE_ERROR_ENVIRONMENT";
    case PYENGINE_ERROR_MODEL: return "PYENGINE_ERROR_MODEL";
    case PYENGINE_ERROR_CLOSED: return "PYENGINE_ERROR_CLOSED";
    case PYENGINE_ERROR_BUFFER_TOO_SMALL: return "PYENGINE_ERROR_BUFFER_TOO_SMALL";
    case PYENGINE_ERROR_UNSUPPORTED: return "PYENGINE_ERROR_UNSUPPORTED";
    case PYENGINE_ERROR_ENGINE: return "PYENGINE_ERROR_ENGINE";
    case PYENGINE_ERROR_NOT_FINISHED: return "PYENGINE_ERROR_NOT_FINISHED";
    case PYENGINE_ERROR_INTERNAL: return "PYENGINE_ERROR_INTERNAL";
  }
  return "unknown status";
}

pyengine_engine_params pyengine_engine_default_params(void) { return pyengine_engine_params{}; }

pyengine_status pyengine_engine_create(const pyengine_engine_params* params,
                                       pyengine_engine** engine) {
  return guarded([&] {
    require(engine != nullptr, "engine (the handle's address) is NULL");
    *engine = nullptr;
    require(params != nullptr, "params is NULL");
    require(params->n_options == 0 || params->options != nullptr,
            "options is NULL but n_options is not 0");
    JsonWriter json;
    json.begin_object().key("model").value(params->model).key("options").begin_object();
    for (std::size_t i = 0; i < params->n_options; ++i) {
      const pyengine_option& option = params->options[i];
      require(option.name != nullptr && option.value != nullptr,
              "an option's name or value is NULL");
      json.key(option.name).value(option.value);
    }
    json.end_object().end_object();
    const std::int64_t key = std::stoll(call(0, Op::kCreate, json.text()));
    auto handle = std::make_unique<pyengine_engine>();
    handle->state = std::make_shared<EngineState>(key);
    LiveEngines::instance().add(handle->state);
    *engine = handle.release();
    return PYENGINE_OK;
  });
}

pyengine_status pyengine_engine_shutdown(pyengine_engine* engine) {
  return guarded([&] {
    require(engine != nullptr, "engine is NULL");
    EngineState& state = *engine->state;
    require(!state.on_delivery_thread(),
            "pyengine_engine_shutdown was called from a request's callback: call it from "
            "another thread");
    if (!state.close()) return PYENGINE_OK;  // (closed already; new calls fail from here on)
    try {
      call(state.key(), Op::kShutdown, "");
    } catch (...) {
      state.stop_delivery();
      throw;
    }
    state.stop_delivery();  // (after the engine's last events: every callback has run)
    return PYENGINE_OK;
  });
}

void pyengine_engine_free(pyengine_engine* engine) {
  if (engine == nullptr) return;
  std::unique_ptr<pyengine_engine> owned(engine);
  pyengine_engine_shutdown(engine);
}

pyengine_status pyengine_engine_get_info(pyengine_engine* engine, pyengine_engine_info* info) {
  return guarded([&] {
    EngineState& state = open_engine(engine);
    require(info != nullptr, "info is NULL");
    const std::string bytes = call(state.key(), Op::kInfo, "");
    std::int32_t fields[6] = {};
    require(bytes.size() == sizeof fields, "bridge.py's info has the wrong size");
    std::memcpy(fields, bytes.data(), sizeof fields);
    *info = pyengine_engine_info{fields[0], fields[1], fields[2], fields[3], fields[4] != 0,
                                 fields[5] != 0};
    return PYENGINE_OK;
  });
}

pyengine_status pyengine_engine_get_stats(pyengine_engine* engine, pyengine_stats* stats) {
  return guarded([&] {
    EngineState& state = open_engine(engine);
    require(stats != nullptr, "stats is NULL");
    const std::string bytes = call(state.key(), Op::kStats, "");
    double f[8] = {};
    require(bytes.size() == sizeof f, "bridge.py's stats have the wrong size");
    std::memcpy(f, bytes.data(), sizeof f);
    auto count = [](double x) { return static_cast<int64_t>(x); };
    *stats = pyengine_stats{count(f[0]), count(f[1]), count(f[2]), f[3], f[4],
                            count(f[5]), count(f[6]), count(f[7])};
    return PYENGINE_OK;
  });
}

pyengine_status pyengine_tokenize(pyengine_engine* engine, const char* text,
                                  bool add_special_tokens, int32_t* tokens, size_t capacity,
                                  size_t* length) {
  return guarded([&] {
    EngineState& state = open_engine(engine);
    require(text != nullptr && length != nullptr, "text or length is NULL");
    require(capacity == 0 || tokens != nullptr, "tokens is NULL but capacity is not 0");
    JsonWriter json;
    json.begin_object().key("text").value(text);
    json.key("add_special_tokens").value(add_special_tokens).end_object();
    return copy_out(call(state.key(), Op::kTokenize, json.text()), tokens, capacity, length);
  });
}

pyengine_status pyengine_detokenize(pyengine_engine* engine, const int32_t* tokens,
                                    size_t n_tokens, bool skip_special_tokens, char* text,
                                    size_t capacity, size_t* length) {
  return guarded([&] {
    EngineState& state = open_engine(engine);
    require(n_tokens == 0 || tokens != nullptr, "tokens is NULL but n_tokens is not 0");
    require(length != nullptr, "length is NULL");
    require(capacity == 0 || text != nullptr, "text is NULL but capacity is not 0");
    JsonWriter json;
    json.begin_object().key("tokens").begin_array();
    for (std::size_t i = 0; i < n_tokens; ++i) json.value(tokens[i]);
    json.end_array().key("skip_special_tokens").value(skip_special_tokens).end_object();
    return copy_out(call(state.key(), Op::kDetokenize, json.text()), text, capacity, length);
  });
}

pyengine_status pyengine_chat_apply_template(pyengine_engine* engine,
                                             const pyengine_chat_message* messages,
                                             size_t n_messages, bool add_generation_prompt,
                                             char* text, size_t capacity, size_t* length) {
  return guarded([&] {
    EngineState& state = open_engine(engine);
    require(length != nullptr, "length is NULL");
    require(capacity == 0 || text != nullptr, "text is NULL but capacity is not 0");
    JsonWriter json;
    json.begin_object();
    write_messages(json.key("messages"), messages, n_messages);
    json.key("add_generation_prompt").value(add_generation_prompt).end_object();
    return copy_out(call(state.key(), Op::kChatTemplate, json.text()), text, capacity, length);
  });
}

pyengine_sampling_params pyengine_sampling_default_params(void) {
  pyengine_sampling_params p{};
  p.n = 1;
  p.max_tokens = 16;
  p.temperature = 1.0f;
  p.top_p = 1.0f;
  p.repetition_penalty = 1.0f;
  p.seed = -1;
  p.skip_special_tokens = true;
  p.logprobs = -1;
  return p;
}

pyengine_request_params pyengine_request_default_params(void) {
  pyengine_request_params p{};
  p.sampling = pyengine_sampling_default_params();
  return p;
}

pyengine_status pyengine_submit(pyengine_engine* engine, const pyengine_request_params* params,
                                pyengine_request** request) {
  return guarded([&] {
    require(request != nullptr, "request (the handle's address) is NULL");
    *request = nullptr;
    EngineState& engine_state = open_engine(engine);
    require(params != nullptr, "params is NULL");
    require(params->sampling.n >= 1, "sampling.n must be at least 1");
    const std::int64_t key = next_request_key.fetch_add(1);
    const std::string json = request_json(key, *params);
    auto state = std::make_shared<RequestState>(key, engine->state, params->sampling.n,
                                                params->callback, params->user_data);
    auto handle = std::make_unique<pyengine_request>();
    handle->state = state;
    state->set_handle(handle.get());
    pyengine::capi::register_request(state);  // (its first events may come at once)
    try {
      call(engine_state.key(), Op::kSubmit, json);
    } catch (...) {
      pyengine::capi::unregister_request(key);
      throw;
    }
    *request = handle.release();
    return PYENGINE_OK;
  });
}

pyengine_status pyengine_request_next(pyengine_request* request, pyengine_event* event,
                                      int32_t timeout_ms) {
  return guarded([&] {
    require(request != nullptr && event != nullptr, "request or event is NULL");
    require(!request->state->has_callback(),
            "the request has a callback, which takes its events: there are none to poll");
    return request->state->next(event, timeout_ms);
  });
}

pyengine_status pyengine_request_wait(pyengine_request* request, int32_t timeout_ms) {
  return guarded([&] {
    require(request != nullptr, "request is NULL");
    return request->state->wait(timeout_ms);
  });
}

pyengine_status pyengine_request_output(pyengine_request* request, int32_t index,
                                        pyengine_output* output) {
  return guarded([&] {
    require(request != nullptr && output != nullptr, "request or output is NULL");
    return request->state->output(index, output);
  });
}

pyengine_status pyengine_request_abort(pyengine_request* request) {
  return guarded([&] {
    require(request != nullptr, "request is NULL");
    request->state->abort();
    return PYENGINE_OK;
  });
}

bool pyengine_request_finished(pyengine_request* request) {
  return request != nullptr && request->state->finished();
}

void pyengine_request_free(pyengine_request* request) {
  if (request == nullptr) return;
  std::unique_ptr<pyengine_request> owned(request);
  pyengine::capi::unregister_request(request->state->key());  // (its later events go)
  request->state->silence();
  guarded([&] {
    request->state->abort();
    return PYENGINE_OK;
  });
}

pyengine_embed_params pyengine_embed_default_params(void) {
  return pyengine_embed_params{true, 0};
}

pyengine_status pyengine_embed(pyengine_engine* engine, const char* const* texts,
                               size_t n_texts, const pyengine_embed_params* params,
                               float* embeddings, size_t capacity, size_t* dimension) {
  return guarded([&] {
    EngineState& state = open_engine(engine);
    require(texts != nullptr && n_texts > 0, "texts is NULL or n_texts is 0");
    require(dimension != nullptr, "dimension is NULL");
    require(capacity == 0 || embeddings != nullptr, "embeddings is NULL but capacity is not 0");
    const pyengine_embed_params p = params != nullptr ? *params : pyengine_embed_default_params();
    require(p.dimensions >= 0, "dimensions must be 0 (all) or more");
    JsonWriter json;
    json.begin_object().key("texts").begin_array();
    for (std::size_t i = 0; i < n_texts; ++i) {
      require(texts[i] != nullptr, "a text is NULL");
      json.value(texts[i]);
    }
    json.end_array().key("normalize").value(p.normalize).key("dimensions");
    p.dimensions == 0 ? json.null() : json.value(p.dimensions);
    const std::string bytes = call(state.key(), Op::kEmbed, json.end_object().text());
    std::int32_t dim = 0;
    require(bytes.size() >= sizeof dim, "bridge.py's embeddings have no dimension");
    std::memcpy(&dim, bytes.data(), sizeof dim);
    *dimension = static_cast<std::size_t>(dim);
    std::size_t floats = 0;
    return copy_out(bytes.substr(sizeof dim), embeddings, capacity, &floats);
  });
}

}  // extern "C"
