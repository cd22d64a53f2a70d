/* The C API's checks that tests/c_api/test_c_api.py runs, each a subcommand; each line
 * printed is "ok NAME" or "FAIL NAME: why", and the exit status is the count of FAILs.
 * Built with -std=c99 -Wall -Werror -pedantic: the header is C99. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pyengine/pyengine_c.h"

static int failures = 0;

static void check(int condition, const char *name, const char *why) {
  if (condition) {
    printf("ok %s\n", name);
  } else {
    printf("FAIL %s: %s (last error: %s)\n", name, why, pyengine_last_error());
    ++failures;
  }
  fflush(stdout);
}

static int contains(const char *text, const char *part) {
  return text != NULL && strstr(text, part) != NULL;
}

/* This process's threads. */
static int count_threads(void) {
  DIR *dir = opendir("/proc/self/task");
  struct dirent *entry;
  int n = 0;
  if (dir == NULL) return -1;
  while ((entry = readdir(dir)) != NULL)
    if (entry->d_name[0] != '.') ++n;
  closedir(dir);
  return n;
}

/* The main thread's child processes (the engine's workers are spawned from it). */
static int count_children(void) {
  char line[512];
  FILE *file;
  int n = 0;
  file = fopen("/proc/thread-self/children", "r");
  if (file == NULL) return 0;
  while (fscanf(file, "%511s", line) == 1) {
    char path[600], command[512] = "";
    FILE *cmdline;
    sprintf(path, "/proc/%s/cmdline", line);
    cmdline = fopen(path, "r");
    if (cmdline != NULL) {
      size_t got = fread(command, 1, sizeof command - 1, cmdline);
      size_t k;
      for (k = 0; k < got; ++k) if (command[k] == '\0') command[k] = ' ';
      fclose(cmdline);
    }
    printf("child %s: %s\n", line, command);
    ++n;
  }
  fclose(file);
  return n;
}

static pyengine_engine *create(int argc, char **argv) {
  pyengine_option options[16];
  pyengine_engine_params params = pyengine_engine_default_params();
  pyengine_engine *engine = NULL;
  int i, n = 0;
  for (i = 0; i < argc && n < 16; ++i) {
    char *equals = strchr(argv[i], '=');
    if (equals == NULL) continue;
    *equals = '\0';
    options[n].name = argv[i];
    options[n].value = equals + 1;
    ++n;
  }
  params.options = options;
  params.n_options = (size_t)n;
  if (pyengine_engine_create(&params, &engine) != PYENGINE_OK) {
    printf("FAIL create: %s\n", pyengine_last_error());
    exit(1);
  }
  return engine;
}

static void errors(void) {
  pyengine_engine_params params = pyengine_engine_default_params();
  pyengine_option bad = {"no_such_option", "1"};
  pyengine_option bad_value = {"max_model_len", "many"};
  pyengine_engine *engine = (pyengine_engine *)&params; /* (must be reset to NULL) */
  pyengine_status status;

  check(strcmp(pyengine_version(), "") != 0, "version", "empty");
  check(pyengine_abi_version() == PYENGINE_ABI_VERSION, "abi", "differs from the header's");
  params.model = "/no/such/model/folder";
  status = pyengine_engine_create(&params, &engine);
  check(status == PYENGINE_ERROR_MODEL && engine == NULL &&
            contains(pyengine_last_error(), "/no/such/model/folder"),
        "bad_model_path", pyengine_status_name(status));
  params.model = NULL;
  params.options = &bad;
  params.n_options = 1;
  status = pyengine_engine_create(&params, &engine);
  check(status == PYENGINE_ERROR_INVALID_ARGUMENT &&
            contains(pyengine_last_error(), "unknown engine option 'no_such_option'"),
        "bad_option_name", pyengine_status_name(status));
  params.options = &bad_value;
  status = pyengine_engine_create(&params, &engine);
  check(status == PYENGINE_ERROR_INVALID_ARGUMENT &&
            contains(pyengine_last_error(), "max_model_len"),
        "bad_option_value", pyengine_status_name(status));
  status = pyengine_engine_create(NULL, &engine);
  check(status == PYENGINE_ERROR_INVALID_ARGUMENT, "null_params", pyengine_status_name(status));
}

static void text(pyengine_engine *engine) {
  int32_t tokens[64];
  char out[256];
  size_t length = 0;
  pyengine_chat_message message = {"user", "Hello there"};
  pyengine_status status;

  status = pyengine_tokenize(engine, "Hello world", false, tokens, 64, &length);
  check(status == PYENGINE_OK && length > 0, "tokenize", pyengine_status_name(status));
  status = pyengine_detokenize(engine, tokens, length, true, out, sizeof out, &length);
  check(status == PYENGINE_OK && strcmp(out, "Hello world") == 0, "detokenize", out);
  status = pyengine_detokenize(engine, tokens, 2, true, out, 1, &length);
  check(status == PYENGINE_ERROR_BUFFER_TOO_SMALL && length == strlen("Hello world"),
        "buffer_too_small", pyengine_status_name(status));
  status = pyengine_chat_apply_template(engine, &message, 1, true, out, sizeof out, &length);
  check(status == PYENGINE_OK && contains(out, "Hello there"), "chat_template", out);
}

static pyengine_status submit(pyengine_engine *engine, pyengine_request_params *params,
                              pyengine_request **request) {
  *request = NULL;
  return pyengine_submit(engine, params, request);
}

static void bad_requests(pyengine_engine *engine) {
  pyengine_request_params params = pyengine_request_default_params();
  pyengine_request *request;
  int32_t tokens[2] = {1, 2};
  pyengine_status status;

  params.prompt = "Hello";
  params.prompt_tokens = tokens;
  params.n_prompt_tokens = 2;
  status = submit(engine, &params, &request);
  check(status == PYENGINE_ERROR_INVALID_ARGUMENT && request == NULL &&
            contains(pyengine_last_error(), "exactly one prompt"),
        "two_prompts", pyengine_status_name(status));
  params.prompt_tokens = NULL;
  params.n_prompt_tokens = 0;
  params.sampling.temperature = -1.0f;
  status = submit(engine, &params, &request);
  check(status == PYENGINE_ERROR_INVALID_ARGUMENT && contains(pyengine_last_error(), "temperature"),
        "bad_temperature", pyengine_status_name(status));
  params.sampling = pyengine_sampling_default_params();
  params.sampling.extra_json = "{\"no_such_param\": 1}";
  status = submit(engine, &params, &request);
  check(status == PYENGINE_ERROR_INVALID_ARGUMENT &&
            contains(pyengine_last_error(), "no_such_param"),
        "bad_extra_param", pyengine_status_name(status));
  params.sampling = pyengine_sampling_default_params();
  params.sampling.json_schema = "{\"type\": \"no-such-type\"}";
  status = submit(engine, &params, &request);
  check(status == PYENGINE_ERROR_INVALID_ARGUMENT && contains(pyengine_last_error(), "json"),
        "bad_schema", pyengine_status_name(status));
  params.sampling = pyengine_sampling_default_params();
  params.priority = 5;
  status = submit(engine, &params, &request);
  check(status == PYENGINE_ERROR_INVALID_ARGUMENT && contains(pyengine_last_error(), "priority"),
        "priority_needs_its_policy", pyengine_status_name(status));
  params.priority = 0;
  tokens[0] = 1 << 30;
  params.prompt = NULL;
  params.prompt_tokens = tokens;
  params.n_prompt_tokens = 1;
  status = submit(engine, &params, &request);
  check(status == PYENGINE_ERROR_INVALID_ARGUMENT && contains(pyengine_last_error(), "vocabulary"),
        "bad_token_id", pyengine_status_name(status));
}

/* A long request, aborted after its first tokens: its blocks come back. */
static void abort_frees_blocks(pyengine_engine *engine) {
  pyengine_request_params params = pyengine_request_default_params();
  pyengine_request *request;
  pyengine_event event;
  pyengine_stats before, during, after;
  pyengine_output output;
  int events = 0, aborted = 0;

  pyengine_engine_get_stats(engine, &before);
  params.prompt = "Once upon a time, in a land far away,";
  params.sampling.max_tokens = 4000;
  params.sampling.ignore_eos = true;
  params.sampling.temperature = 0.0f;
  check(submit(engine, &params, &request) == PYENGINE_OK, "submit_long", "refused");
  while (pyengine_request_next(request, &event, -1) == PYENGINE_OK) {
    if (++events == 3) {
      pyengine_engine_get_stats(engine, &during);
      check(pyengine_request_abort(request) == PYENGINE_OK, "abort", "failed");
    }
    if (event.request_finished) aborted = event.finish_reason == PYENGINE_FINISH_ABORT;
  }
  check(aborted, "abort_event", "the last event is not an abort");
  check(during.kv_cache_usage > before.kv_cache_usage && during.num_running == 1,
        "blocks_used_while_running", "no blocks in use");
  pyengine_engine_get_stats(engine, &after);
  check(after.kv_cache_usage == before.kv_cache_usage && after.num_running == 0 &&
            after.num_unfinished == 0,
        "abort_frees_blocks", "blocks still in use after the abort");
  check(pyengine_request_output(request, 0, &output) == PYENGINE_OK &&
            output.finish_reason == PYENGINE_FINISH_ABORT && output.n_tokens >= 3 &&
            output.n_tokens < 4000,
        "aborted_output", "wrong output");
  pyengine_request_free(request);
}

static bool stop_after_three(const pyengine_event *event, void *user_data) {
  int *seen = (int *)user_data;
  (void)event;
  return ++*seen < 3;
}

static void check_workers_gone(void) {
  check(count_children() == 0, "exit_no_worker_left", "a child process outlived the engine");
}

static bool count_events(const pyengine_event *event, void *user_data) {
  (void)event;
  ++*(int *)user_data;
  return true;
}

static void callback_abort(pyengine_engine *engine) {
  pyengine_request_params params = pyengine_request_default_params();
  pyengine_request *request;
  pyengine_output output;
  pyengine_event event;
  int seen = 0;

  params.prompt = "Count to one thousand:";
  params.sampling.max_tokens = 4000;
  params.sampling.ignore_eos = true;
  params.callback = stop_after_three;
  params.user_data = &seen;
  check(submit(engine, &params, &request) == PYENGINE_OK, "submit_callback", "refused");
  check(pyengine_request_wait(request, 60000) == PYENGINE_OK, "callback_wait", "timed out");
  check(pyengine_request_output(request, 0, &output) == PYENGINE_OK &&
            output.finish_reason == PYENGINE_FINISH_ABORT,
        "callback_abort", "the request was not aborted");
  check(pyengine_request_next(request, &event, 0) == PYENGINE_ERROR_INVALID_ARGUMENT,
        "no_polling_with_callback", "events polled");
  pyengine_request_free(request);
}

static void closed(pyengine_engine *engine) {
  pyengine_request_params params = pyengine_request_default_params();
  pyengine_request *request = NULL, *running = NULL;
  pyengine_stats stats;
  pyengine_output output;
  int32_t tokens[8];
  size_t length;
  pyengine_status status;

  params.prompt = "A request that the shutdown ends:";
  params.sampling.max_tokens = 4000;
  params.sampling.ignore_eos = true;
  check(submit(engine, &params, &running) == PYENGINE_OK, "submit_before_shutdown", "refused");
  check(pyengine_engine_shutdown(engine) == PYENGINE_OK, "shutdown", "failed");
  check(pyengine_request_finished(running) &&
            pyengine_request_output(running, 0, &output) == PYENGINE_OK &&
            output.finish_reason == PYENGINE_FINISH_ABORT,
        "shutdown_aborts", "a request outlived the shutdown");
  pyengine_request_free(running);
  status = submit(engine, &params, &request);
  check(status == PYENGINE_ERROR_CLOSED && contains(pyengine_last_error(), "shut down"),
        "closed_submit", pyengine_status_name(status));
  status = pyengine_tokenize(engine, "x", true, tokens, 8, &length);
  check(status == PYENGINE_ERROR_CLOSED, "closed_tokenize", pyengine_status_name(status));
  status = pyengine_engine_get_stats(engine, &stats);
  check(status == PYENGINE_ERROR_CLOSED, "closed_stats", pyengine_status_name(status));
  check(pyengine_engine_shutdown(engine) == PYENGINE_OK, "shutdown_twice", "failed");
}

static void embed_unsupported(pyengine_engine *engine) {
  const char *texts[1] = {"hello"};
  float out[4];
  size_t dim = 0;
  pyengine_status status = pyengine_embed(engine, texts, 1, NULL, out, 4, &dim);
  check(status == PYENGINE_ERROR_UNSUPPORTED && contains(pyengine_last_error(), "pooling"),
        "embed_needs_pooling", pyengine_status_name(status));
}

/* Each request's outputs as lines: "tokens NAME SAMPLE ids...", "finish NAME SAMPLE
 * reason", "text NAME SAMPLE hex", and with logprobs "logprobs NAME lp..." and
 * "top NAME id lp id lp ...". */
static void print_request(const char *name, pyengine_request *request, int n) {
  pyengine_event event;
  pyengine_output output;
  int i;
  size_t k;
  while (pyengine_request_next(request, &event, -1) == PYENGINE_OK) {
    if (event.status != PYENGINE_OK) printf("FAIL %s: %s\n", name, event.error);
    if (event.logprobs == NULL) continue;
    printf("logprobs %s", name);
    for (k = 0; k < event.n_tokens; ++k) printf(" %.6f", event.logprobs[k]);
    printf("\ntop %s", name);
    for (k = 0; k < event.n_tokens * event.top_k; ++k)
      printf(" %d %.6f", (int)event.top_tokens[k], event.top_logprobs[k]);
    printf("\n");
  }
  for (i = 0; i < n; ++i) {
    if (pyengine_request_output(request, i, &output) != PYENGINE_OK) {
      printf("FAIL %s: %s\n", name, pyengine_last_error());
      continue;
    }
    printf("tokens %s %d", name, i);
    for (k = 0; k < output.n_tokens; ++k) printf(" %d", (int)output.tokens[k]);
    printf("\nfinish %s %d %d\ntext %s %d ", name, i, (int)output.finish_reason, name, i);
    for (k = 0; k < output.text_len; ++k) printf("%02x", (unsigned char)output.text[k]);
    printf("\n");
  }
  pyengine_request_free(request);
}

#define N_SAMPLING 9

/* Requests of every kind of parameter, submitted together (one batch). */
static void sampling(pyengine_engine *engine, const char *adapter) {
  static const char *const stops[1] = {" seven"};
  static const pyengine_chat_message chat[1] = {{"user", "What is 2+2?"}};
  const char *names[N_SAMPLING] = {"logprobs", "stop", "seeded", "n2", "json", "regex",
                                   "chat", "extra", "lora"};
  pyengine_request *requests[N_SAMPLING];
  pyengine_lora lora;
  int i;
  for (i = 0; i < N_SAMPLING; ++i) {
    pyengine_request_params p = pyengine_request_default_params();
    p.prompt = "The capital of France is";
    p.sampling.temperature = 0.0f;
    p.sampling.max_tokens = 8;
    switch (i) {
      case 0: p.sampling.logprobs = 3; break;
      case 1:
        p.prompt = "Count from one to ten: one, two, three,";
        p.sampling.max_tokens = 40;
        p.sampling.stop = stops;
        p.sampling.n_stop = 1;
        break;
      case 2: p.sampling.temperature = 1.0f; p.sampling.seed = 1234; break;
      case 3: p.sampling.temperature = 0.8f; p.sampling.seed = 7; p.sampling.n = 2; break;
      case 4:
        p.prompt = "A JSON object with an integer field a:";
        p.sampling.max_tokens = 30;
        p.sampling.json_schema =
            "{\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\"}}, "
            "\"required\": [\"a\"]}";
        break;
      case 5: p.prompt = "Call 555-"; p.sampling.regex = "[0-9]{3}-[0-9]{4}"; break;
      case 6: p.prompt = NULL; p.messages = chat; p.n_messages = 1; break;
      case 7: p.sampling.extra_json = "{\"bad_words\": [\" Paris\"], \"min_tokens\": 4}"; break;
      case 8:
        lora.name = "adapter";
        lora.id = 1;
        lora.path = adapter;
        p.lora = &lora;
        break;
    }
    if (pyengine_submit(engine, &p, &requests[i]) != PYENGINE_OK) {
      printf("FAIL submit %s: %s\n", names[i], pyengine_last_error());
      requests[i] = NULL;
    }
  }
  for (i = 0; i < N_SAMPLING; ++i)
    if (requests[i] != NULL) print_request(names[i], requests[i], i == 3 ? 2 : 1);
}

/* checks errors | checks engine OPTION=VALUE... | checks exit OPTION=VALUE...
 * | checks sampling ADAPTER OPTION=VALUE... | checks embed MODEL TEXT... */
int main(int argc, char **argv) {
  if (argc >= 2 && strcmp(argv[1], "errors") == 0) {
    errors();
  } else if (argc >= 2 && strcmp(argv[1], "engine") == 0) {
    pyengine_engine *engine = create(argc - 2, argv + 2);
    int threads;
    text(engine);
    bad_requests(engine);
    abort_frees_blocks(engine);
    callback_abort(engine);
    embed_unsupported(engine);
    closed(engine);
    pyengine_engine_free(engine);
    /* A second engine leaves nothing behind either: the threads now are the libraries'
     * own (numpy's BLAS pool), started once when Python imported them. */
    threads = count_threads();
    engine = create(argc - 2, argv + 2);
    abort_frees_blocks(engine);
    pyengine_engine_free(engine);
    check(count_threads() == threads, "no_thread_left", "threads outlived the engine");
    check(count_children() == 0, "no_worker_left", "a child process outlived the engine");
  } else if (argc >= 2 && strcmp(argv[1], "exit") == 0) {
    /* Leaves the engine open, two requests running (one with a callback): the library
     * shuts it down as the process exits. */
    pyengine_engine *engine;
    pyengine_request_params params = pyengine_request_default_params();
    pyengine_request *polled, *called;
    pyengine_event event;
    static int seen = 0;
    atexit(check_workers_gone); /* (before the library's own: it runs after it) */
    engine = create(argc - 2, argv + 2);
    params.prompt = "Once upon a time";
    params.sampling.max_tokens = 4000;
    params.sampling.ignore_eos = true;
    check(pyengine_submit(engine, &params, &polled) == PYENGINE_OK, "exit_submit", "refused");
    params.callback = count_events;
    params.user_data = &seen;
    check(pyengine_submit(engine, &params, &called) == PYENGINE_OK, "exit_submit_2", "refused");
    check(pyengine_request_next(polled, &event, -1) == PYENGINE_OK, "exit_running", "no event");
    return failures;
  } else if (argc >= 3 && strcmp(argv[1], "sampling") == 0) {
    pyengine_engine *engine = create(argc - 3, argv + 3);
    sampling(engine, argv[2]);
    pyengine_engine_free(engine);
  } else if (argc >= 4 && strcmp(argv[1], "embed") == 0) {
    pyengine_engine_params params = pyengine_engine_default_params();
    pyengine_option options[2] = {{"runner", "pooling"}, {"dtype", "float32"}};
    pyengine_engine *engine = NULL;
    pyengine_embed_params embed = pyengine_embed_default_params();
    size_t n = (size_t)(argc - 3), dim = 0, i, j;
    float *rows;
    params.model = argv[2];
    params.options = options;
    params.n_options = 2;
    if (pyengine_engine_create(&params, &engine) != PYENGINE_OK) {
      printf("FAIL create: %s\n", pyengine_last_error());
      return 1;
    }
    check(pyengine_embed(engine, (const char *const *)argv + 3, n, &embed, NULL, 0, &dim) ==
              PYENGINE_ERROR_BUFFER_TOO_SMALL && dim > 0,
          "embed_size", "no dimension");
    rows = (float *)malloc(n * dim * sizeof(float));
    check(pyengine_embed(engine, (const char *const *)argv + 3, n, &embed, rows, n * dim, &dim) ==
              PYENGINE_OK,
          "embed", "failed");
    for (i = 0; i < n; ++i) {
      printf("row");
      for (j = 0; j < dim; ++j) printf(" %.9g", rows[i * dim + j]);
      printf("\n");
    }
    free(rows);
    pyengine_engine_free(engine);
  } else {
    fprintf(stderr, "usage: %s errors | engine OPTION=VALUE... | sampling ADAPTER OPTION=VALUE..."
            " | embed MODEL TEXT...\n", argv[0]);
    return 2;
  }
  return failures;
}
