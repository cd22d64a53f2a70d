/* Streams a completion of each prompt through pyengine's C API, printing text as the
 * engine makes it.
 *
 *   stream_completion [--model M] [--max-tokens N] [--temperature T] [--option NAME=VALUE]...
 *                     [--ids] PROMPT...
 *
 * --option passes an engine option (an EngineArgs field): --option dtype=float32.
 * --ids prints each completion's token ids instead of its text, one line per prompt. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pyengine/pyengine_c.h"

#define MAX_OPTIONS 32

static int fail(const char *what, pyengine_status status) {
  fprintf(stderr, "%s failed: %s: %s\n", what, pyengine_status_name(status),
          pyengine_last_error());
  return 1;
}

/* Polls one request's events until its end, printing text (or, with ids, the tokens). */
static int stream(pyengine_request *request, int ids) {
  pyengine_event event;
  pyengine_status status;
  size_t i;
  while ((status = pyengine_request_next(request, &event, -1)) == PYENGINE_OK) {
    if (event.status != PYENGINE_OK) {
      fprintf(stderr, "the request failed: %s\n", event.error);
      return 1;
    }
    if (ids) {
      for (i = 0; i < event.n_tokens; ++i) printf(" %d", (int)event.tokens[i]);
    } else {
      fwrite(event.text, 1, event.text_len, stdout);
    }
    fflush(stdout);
  }
  printf("\n");
  return status == PYENGINE_DONE ? 0 : fail("pyengine_request_next", status);
}

int main(int argc, char **argv) {
  pyengine_option options[MAX_OPTIONS];
  pyengine_engine_params engine_params = pyengine_engine_default_params();
  pyengine_request_params params = pyengine_request_default_params();
  pyengine_engine *engine = NULL;
  pyengine_status status;
  size_t n_options = 0;
  int ids = 0, failed = 0, i;

  params.sampling.max_tokens = 64;
  params.sampling.temperature = 0.0f; /* greedy */
  for (i = 1; i < argc && strncmp(argv[i], "--", 2) == 0; ++i) {
    if (strcmp(argv[i], "--ids") == 0) {
      ids = 1;
    } else if (i + 1 >= argc) {
      fprintf(stderr, "%s needs a value\n", argv[i]);
      return 2;
    } else if (strcmp(argv[i], "--model") == 0) {
      engine_params.model = argv[++i];
    } else if (strcmp(argv[i], "--max-tokens") == 0) {
      params.sampling.max_tokens = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--temperature") == 0) {
      params.sampling.temperature = (float)atof(argv[++i]);
    } else if (strcmp(argv[i], "--option") == 0 && n_options < MAX_OPTIONS) {
      char *equals = strchr(argv[++i], '=');
      if (equals == NULL) {
        fprintf(stderr, "--option takes NAME=VALUE, got %s\n", argv[i]);
        return 2;
      }
      *equals = '\0';
      options[n_options].name = argv[i];
      options[n_options].value = equals + 1;
      ++n_options;
    } else {
      fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  if (i == argc) {
    fprintf(stderr, "usage: %s [options] PROMPT...\n", argv[0]);
    return 2;
  }
  engine_params.options = options;
  engine_params.n_options = n_options;
  status = pyengine_engine_create(&engine_params, &engine);
  if (status != PYENGINE_OK) return fail("pyengine_engine_create", status);

  for (; i < argc && !failed; ++i) {
    pyengine_request *request = NULL;
    params.prompt = argv[i];
    status = pyengine_submit(engine, &params, &request);
    if (status != PYENGINE_OK) {
      failed = fail("pyengine_submit", status);
    } else {
      failed = stream(request, ids);
      pyengine_request_free(request);
    }
  }
  pyengine_engine_free(engine);
  return failed;
}
