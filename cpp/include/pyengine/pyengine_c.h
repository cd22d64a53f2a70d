/* pyengine's C API: the whole engine (every model, quantized form, parallelism and
 * speculation that LLM and `pyengine serve` run) behind opaque handles, in the manner of
 * llama.cpp's llama.h. Link libpyengine (find_package(pyengine): pyengine::pyengine, or
 * pkg-config pyengine); compile as C99 or later, or C++.
 *
 * The library runs pyengine's Python layer in an interpreter that it starts itself: it
 * finds the environment pyengine was installed into (or the one whose python
 * PYENGINE_PYTHON names) and reports a missing or broken one as
 * PYENGINE_ERROR_ENVIRONMENT. The caller never touches Python.
 *
 * Threads: every function may be called from any thread. Requests submitted from many
 * threads at once run in one continuous batch. A request's events are read by one
 * thread at a time, through its callback or by polling.
 *
 * Errors: a function that fails returns a negative pyengine_status, and
 * pyengine_last_error() on the same thread says why in words. */
#ifndef PYENGINE_PYENGINE_C_H
#define PYENGINE_PYENGINE_C_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__) || defined(__clang__)
#define PYENGINE_API __attribute__((visibility("default")))
#else
#define PYENGINE_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Raised whenever a struct below changes its layout; pyengine_abi_version() says the
 * library's. */
#define PYENGINE_ABI_VERSION 1

typedef enum pyengine_status {
  PYENGINE_OK = 0,
  PYENGINE_TIMEOUT = 1, /* nothing arrived within the timeout (not an error) */
  PYENGINE_DONE = 2,    /* the request has finished and every event was taken */
  PYENGINE_ERROR_INVALID_ARGUMENT = -1, /* a bad argument, option or parameter */
  PYENGINE_ERROR_ENVIRONMENT = -2,      /* Python or the pyengine package: missing, broken */
  PYENGINE_ERROR_MODEL = -3,            /* the model could not be found or loaded */
  PYENGINE_ERROR_CLOSED = -4,           /* the engine has been shut down */
  PYENGINE_ERROR_BUFFER_TOO_SMALL = -5, /* the size needed is where the length goes */
  PYENGINE_ERROR_UNSUPPORTED = -6,      /* not what this model runs (embed on a generator) */
  PYENGINE_ERROR_ENGINE = -7,           /* a step failed; the engine said why */
  PYENGINE_ERROR_NOT_FINISHED = -8,     /* a whole output asked of a running request */
  PYENGINE_ERROR_INTERNAL = -9          /* a bug in pyengine: the text says where */
} pyengine_status;

typedef enum pyengine_finish_reason {
  PYENGINE_FINISH_NONE = 0,   /* still running */
  PYENGINE_FINISH_STOP = 1,   /* an end-of-sequence token, a stop string or stop token */
  PYENGINE_FINISH_LENGTH = 2, /* max_tokens, or max_model_len */
  PYENGINE_FINISH_ABORT = 3,  /* pyengine_request_abort, or the engine's shutdown */
  PYENGINE_FINISH_ERROR = 4   /* the event's status and error say what failed */
} pyengine_finish_reason;

typedef struct pyengine_engine pyengine_engine;   /* one engine: a model and its batch */
typedef struct pyengine_request pyengine_request; /* one submitted request */

/* ---- the library ------------------------------------------------------------------ */

/* pyengine's version, "MAJOR.MINOR.PATCH". */
PYENGINE_API const char *pyengine_version(void);
/* The struct layouts this library was built with (PYENGINE_ABI_VERSION). */
PYENGINE_API int32_t pyengine_abi_version(void);
/* The failure of this thread's last call that failed, in words; "" where none has. Valid
 * until this thread's next failing call. */
PYENGINE_API const char *pyengine_last_error(void);
/* The status's name, "PYENGINE_ERROR_MODEL"; "unknown status" for other values. */
PYENGINE_API const char *pyengine_status_name(pyengine_status status);

/* ---- the engine ------------------------------------------------------------------- */

/* One engine option: an EngineArgs field by its name ("max_model_len", "dtype",
 * "tensor_parallel_size", ...), the value as the command line writes it: "2048",
 * "float32", "true", "none"; a JSON object for a mapping ("speculative_config"). */
typedef struct pyengine_option {
  const char *name;
  const char *value;
} pyengine_option;

typedef struct pyengine_engine_params {
  /* A model folder, a .gguf file, or a repository id in the local Hugging Face cache;
   * NULL: the default model (SmolLM2-135M-Instruct). */
  const char *model;
  const pyengine_option *options; /* n_options options; NULL where n_options is 0 */
  size_t n_options;
} pyengine_engine_params;

PYENGINE_API pyengine_engine_params pyengine_engine_default_params(void);

/* Loads the model and starts the engine's loop (the first call also starts the
 * interpreter). *engine is set on success, NULL otherwise. */
PYENGINE_API pyengine_status pyengine_engine_create(const pyengine_engine_params *params,
                                                    pyengine_engine **engine);
/* Aborts every request (their events end with PYENGINE_FINISH_ABORT), stops the loop
 * and ends the engine's workers; later calls on the engine give PYENGINE_ERROR_CLOSED.
 * Requests stay readable until freed. Calling it twice is harmless. */
PYENGINE_API pyengine_status pyengine_engine_shutdown(pyengine_engine *engine);
/* Shuts the engine down (if it is not already) and frees the handle; NULL is ignored.
 * Its requests' handles remain valid until each is freed. */
PYENGINE_API void pyengine_engine_free(pyengine_engine *engine);

typedef struct pyengine_engine_info {
  int32_t vocab_size;
  int32_t max_model_len;   /* prompt plus output, in tokens */
  int32_t eos_token_id;    /* -1 where the model has none */
  int32_t embedding_size;  /* the hidden size: a pooling model's embedding length */
  bool pooling;            /* runner "pooling": embeds, generates nothing */
  bool has_chat_template;
} pyengine_engine_info;

PYENGINE_API pyengine_status pyengine_engine_get_info(pyengine_engine *engine,
                                                      pyengine_engine_info *info);

typedef struct pyengine_stats {
  int64_t num_running;           /* requests in the batch */
  int64_t num_waiting;           /* requests queued for room */
  int64_t num_preemptions;       /* since the engine started */
  double kv_cache_usage;         /* the share of KV blocks in use, 0 to 1 */
  double prefix_cache_hit_rate;  /* of the prompt tokens looked up */
  int64_t prefix_cache_queries;  /* prompt tokens looked up since the start */
  int64_t prefix_cache_hits;     /* of those, found */
  int64_t num_unfinished;        /* this engine's requests not yet finished */
} pyengine_stats;

PYENGINE_API pyengine_status pyengine_engine_get_stats(pyengine_engine *engine,
                                                       pyengine_stats *stats);

/* ---- text --------------------------------------------------------------------------
 * A function that fills a caller's buffer sets *length to the size the result needs
 * (tokens, or bytes without the terminating NUL); where capacity is less, it writes
 * nothing and returns PYENGINE_ERROR_BUFFER_TOO_SMALL: call again with that size. Text
 * is UTF-8; a text buffer gets a terminating NUL when there is room for it. */

PYENGINE_API pyengine_status pyengine_tokenize(pyengine_engine *engine, const char *text,
                                               bool add_special_tokens, int32_t *tokens,
                                               size_t capacity, size_t *length);
PYENGINE_API pyengine_status pyengine_detokenize(pyengine_engine *engine,
                                                 const int32_t *tokens, size_t n_tokens,
                                                 bool skip_special_tokens, char *text,
                                                 size_t capacity, size_t *length);

typedef struct pyengine_chat_message {
  const char *role; /* "system", "user", "assistant", "tool" */
  const char *content;
} pyengine_chat_message;

/* The model's chat template applied to the messages: the prompt text. */
PYENGINE_API pyengine_status pyengine_chat_apply_template(
    pyengine_engine *engine, const pyengine_chat_message *messages, size_t n_messages,
    bool add_generation_prompt, char *text, size_t capacity, size_t *length);

/* ---- requests ---------------------------------------------------------------------- */

typedef struct pyengine_sampling_params {
  int32_t n;                  /* samples of the prompt (1) */
  int32_t max_tokens;         /* tokens to generate at most (16); -1: up to max_model_len */
  int32_t min_tokens;         /* before an end-of-sequence or stop token may end it (0) */
  float temperature;          /* 0: greedy (1) */
  float top_p;                /* (1) */
  int32_t top_k;              /* 0: all tokens (0) */
  float min_p;                /* (0) */
  float presence_penalty;     /* (0) */
  float frequency_penalty;    /* (0) */
  float repetition_penalty;   /* (1) */
  int64_t seed;               /* this request's own random stream; -1: none (-1) */
  const char *const *stop;    /* n_stop strings that end the output (not in its text) */
  size_t n_stop;
  const int32_t *stop_token_ids; /* n_stop_token_ids token ids that end the output */
  size_t n_stop_token_ids;
  bool ignore_eos;            /* generate past end-of-sequence tokens (false) */
  bool skip_special_tokens;   /* leave special tokens out of the text (true) */
  int32_t logprobs;           /* per token: its logprob and this many others; -1: none */
  /* Structured outputs, one at most: the output is JSON of this schema (JSON text), a
   * match of this regular expression, a sentence of this Lark grammar, any JSON object. */
  const char *json_schema;
  const char *regex;
  const char *grammar;
  bool json_object;
  /* Any other SamplingParams field by name, as a JSON object ({"logit_bias": {"42":
   * -100}, "bad_words": ["x"]}); it overrides the fields above. NULL: none. */
  const char *extra_json;
} pyengine_sampling_params;

PYENGINE_API pyengine_sampling_params pyengine_sampling_default_params(void);

/* One event of a request: what a step added to one of its samples, or its end. */
typedef struct pyengine_event {
  pyengine_request *request;
  int32_t index;              /* the sample, 0 to n-1 */
  const int32_t *tokens;      /* the n_tokens tokens the step added */
  size_t n_tokens;
  const char *text;           /* their text (UTF-8, NUL-terminated), text_len bytes */
  size_t text_len;
  /* With logprobs asked for: each token's logprob (n_tokens), and for each token the
   * top_k most likely tokens and their logprobs, best first (n_tokens x top_k); NULL
   * otherwise. */
  const float *logprobs;
  const int32_t *top_tokens;
  const float *top_logprobs;
  size_t top_k;
  pyengine_finish_reason finish_reason; /* this sample's end, or PYENGINE_FINISH_NONE */
  bool request_finished;      /* the last event of the request */
  pyengine_status status;     /* PYENGINE_OK, or what ended the request */
  const char *error;          /* the failure in words where status is not PYENGINE_OK */
} pyengine_event;

/* Called on the engine's delivery thread with each event, in order, never twice at once
 * for one engine; the event is valid during the call. Return false to abort the request.
 * A callback that blocks holds up the other requests' callbacks, not the engine. */
typedef bool (*pyengine_event_callback)(const pyengine_event *event, void *user_data);

typedef struct pyengine_lora {
  const char *name; /* the adapter's name */
  int32_t id;       /* > 0, unique among the engine's adapters */
  const char *path; /* its PEFT folder (adapter_config.json, adapter_model.safetensors) */
} pyengine_lora;

typedef struct pyengine_request_params {
  /* The prompt, exactly one of: text; token ids; chat messages (the chat template
   * applied, with the generation prompt). */
  const char *prompt;
  const int32_t *prompt_tokens;
  size_t n_prompt_tokens;
  const pyengine_chat_message *messages;
  size_t n_messages;
  pyengine_sampling_params sampling;
  const pyengine_lora *lora; /* the adapter to run through (enable_lora); NULL: none */
  int32_t priority;          /* scheduling_policy "priority": lower first (0) */
  /* NULL: events are polled with pyengine_request_next. */
  pyengine_event_callback callback;
  void *user_data;
} pyengine_request_params;

PYENGINE_API pyengine_request_params pyengine_request_default_params(void);

/* Checks the request (a bad one fails here, saying why) and queues it into the batch;
 * *request is set on success. Free it with pyengine_request_free. */
PYENGINE_API pyengine_status pyengine_submit(pyengine_engine *engine,
                                             const pyengine_request_params *params,
                                             pyengine_request **request);

/* The next event of a polled request: waits up to timeout_ms (0: not at all; negative:
 * as long as it takes). PYENGINE_OK with *event set; PYENGINE_TIMEOUT; PYENGINE_DONE
 * once the last event was taken. The event stays valid until the next call on the
 * request or its free. A request with a callback has no events to poll. */
PYENGINE_API pyengine_status pyengine_request_next(pyengine_request *request,
                                                   pyengine_event *event,
                                                   int32_t timeout_ms);
/* Waits until the request has finished (timeout_ms as above): PYENGINE_OK, or
 * PYENGINE_TIMEOUT. A polled request's events still wait to be polled; a request with a
 * callback has finished once its callback has returned from the last event. */
PYENGINE_API pyengine_status pyengine_request_wait(pyengine_request *request,
                                                   int32_t timeout_ms);

/* A finished request's whole output of one sample. */
typedef struct pyengine_output {
  const int32_t *tokens;
  size_t n_tokens;
  const char *text; /* NUL-terminated */
  size_t text_len;
  pyengine_finish_reason finish_reason;
  pyengine_status status; /* PYENGINE_OK, or what ended the request */
  const char *error;      /* where status is not PYENGINE_OK */
  int32_t prompt_tokens;  /* the prompt's length in tokens */
} pyengine_output;

/* Sample `index`'s output, valid until the request is freed;
 * PYENGINE_ERROR_NOT_FINISHED while the request runs. */
PYENGINE_API pyengine_status pyengine_request_output(pyengine_request *request,
                                                     int32_t index,
                                                     pyengine_output *output);
/* Aborts the request; returns once the engine has taken the abort (its KV blocks are
 * free; the stats say so after the engine's next step). Its last event says
 * PYENGINE_FINISH_ABORT. A finished request is left as it is. */
PYENGINE_API pyengine_status pyengine_request_abort(pyengine_request *request);
/* Whether the request has finished, as pyengine_request_wait says it. */
PYENGINE_API bool pyengine_request_finished(pyengine_request *request);
/* Aborts the request if it runs and frees the handle; NULL is ignored. No callback of
 * the request runs once it returns. */
PYENGINE_API void pyengine_request_free(pyengine_request *request);

/* ---- embeddings ---------------------------------------------------------------------- */

typedef struct pyengine_embed_params {
  bool normalize;     /* to unit length (true) */
  int32_t dimensions; /* the first this many dimensions (Matryoshka models); 0: all */
} pyengine_embed_params;

PYENGINE_API pyengine_embed_params pyengine_embed_default_params(void);

/* The embeddings of n_texts texts by a pooling model (runner "pooling"), row after row:
 * *dimension is set to each row's length, and capacity (in floats) must hold n_texts
 * rows of it. Texts embedded from many threads at once share the batch. */
PYENGINE_API pyengine_status pyengine_embed(pyengine_engine *engine,
                                            const char *const *texts, size_t n_texts,
                                            const pyengine_embed_params *params,
                                            float *embeddings, size_t capacity,
                                            size_t *dimension);

#ifdef __cplusplus
}
#endif

#endif /* PYENGINE_PYENGINE_C_H */
