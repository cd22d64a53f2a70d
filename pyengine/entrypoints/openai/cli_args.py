"""The server's command line: its options (the engine's share EngineArgs' names and
defaults), and their conversion into EngineArgs and the server's own settings. The same
options serve `python -m pyengine.entrypoints.openai.api_server` and `pyengine serve`."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path

from pyengine.config import PREEMPTION_MODES, QUANTIZED_ACTIVATIONS, SCHEDULING_POLICIES
from pyengine.engine.engine_args import EngineArgs
from pyengine.engine.pooling import RUNNERS
from pyengine.entrypoints.openai.admission import WaitingBound
from pyengine.entrypoints.openai.limits import RequestLimits
from pyengine.entrypoints.openai.middlewares import DEFAULT_MAX_BODY_BYTES
from pyengine.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pyengine.entrypoints.openai.slow_clients import DEFAULT_STALL_TIMEOUT
from pyengine.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser, tool_parser
from pyengine.executor.registry import executor_names
from pyengine.layers.quantization.registry import QUANTIZATION_METHODS


def add_engine_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the engine's options (EngineArgs' fields but the model, each under its name:
    `engine_args` reads them back), which `serve`, `generate` and `chat` all take."""
    d = EngineArgs()
    parser.add_argument("--tokenizer", default=d.tokenizer)
    parser.add_argument("--load-format", default=d.load_format)
    parser.add_argument(
        "--quantization", "-q", choices=list(QUANTIZATION_METHODS), default=d.quantization,
        help="the checkpoint's quantization (default: what its config.json says)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype",
        default=d.dtype,
        help="auto: bfloat16 on CPUs with AMX or AVX512-BF16 (float32 for quantized "
        "checkpoints and on other CPUs), bfloat16 on CUDA; float32: the exact mode",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        help="auto: the model's dtype; bfloat16, float16, fp8 (e4m3) or int8 under float32 "
        "weights (CPU)",
    )
    parser.add_argument(
        "--quantized-activations", choices=["auto", *QUANTIZED_ACTIVATIONS],
        default=d.quantized_activations,
        help="a step's activations for block-quantized CPU layers (GGUF, GPTQ/AWQ): float32 "
        "(the dequantized weights' exact product), int8 (per block of 32, as llama.cpp: "
        "faster), or auto (int8 where --dtype is auto and the CPU has VNNI)",
    )  # fmt: skip
    parser.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="decode steps eagerly: no CUDA graphs, no recorded CPU steps",
    )
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument(
        "-tp", "--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
        help="ranks each layer is split over",
    )  # fmt: skip
    parser.add_argument(
        "-pp", "--pipeline-parallel-size", type=int, default=d.pipeline_parallel_size,
        help="stages the layers are split into",
    )  # fmt: skip
    parser.add_argument(
        "--enable-expert-parallel", action="store_true",
        help="mixture-of-experts layers: whole experts on each tensor-parallel rank",
    )  # fmt: skip
    parser.add_argument(
        "--distributed-executor-backend", choices=executor_names(),
        default=d.distributed_executor_backend,
        help="uni: this process; mp: a process per rank (the default for more than one); "
        "ray: Ray actors across a cluster's nodes",
    )  # fmt: skip
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument(
        "--kv-cache-memory", type=int, default=d.kv_cache_memory, help="bytes (CPU)"
    )
    parser.add_argument(
        "--kv-offload-gb", type=float, default=d.kv_offload_gb, metavar="GIB",
        help="a host-memory tier of the KV cache (per worker; pinned on a GPU): evicted "
        "prefix-cache blocks wait there for a later hit (default: none)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-offload-dir", default=d.kv_offload_dir, metavar="DIR",
        help="on the CPU: the host tier in a file in this folder (deleted at exit)",
    )  # fmt: skip
    parser.add_argument(
        "--preemption-mode", choices=list(PREEMPTION_MODES), default=d.preemption_mode,
        help="recompute: a preempted request's KV is computed again; swap (with "
        "--kv-offload-gb): copied to the host tier and back",
    )  # fmt: skip
    parser.add_argument(
        "--state-checkpoint-interval", type=int, default=d.state_checkpoint_interval,
        metavar="BLOCKS", help="hybrid models with prefix caching: checkpoint the recurrent "
        "states every this many blocks (and at each prompt's last full block)",
    )  # fmt: skip
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
    )
    parser.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=d.enable_chunked_prefill,
    )
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--scheduling-policy", choices=list(SCHEDULING_POLICIES), default=d.scheduling_policy,
        help="fcfs: arrival order; priority: a request's priority first (lower first), "
        "and preemption takes the lowest-priority running request first",
    )  # fmt: skip
    parser.add_argument(
        "--max-logprobs",
        type=int,
        default=d.max_logprobs,
        help="the most logprobs (top_logprobs) a request may ask for",
    )
    parser.add_argument(
        "--enable-lora", action="store_true", help="requests may name LoRA adapters (docs/lora.md)"
    )
    parser.add_argument("--max-loras", type=int, default=d.max_loras)
    parser.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank)
    parser.add_argument("--max-cpu-loras", type=int, default=d.max_cpu_loras)
    parser.add_argument(
        "--speculative-config", type=json_object, default=None, metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        "(docs/speculative.md)",
    )  # fmt: skip
    parser.add_argument(
        "--runner", choices=RUNNERS, default=d.runner,
        help="pooling: embeddings, scores and reranking (/v1/embeddings, /v1/score, "
        "/v1/rerank); auto: pooling for an encoder, else generate",
    )  # fmt: skip
    parser.add_argument(
        "--pooler-config", type=json_object, default=None, metavar="JSON",
        help='the pooling runner\'s, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' or '
        '\'{"classifier_from_token": ["no", "yes"]}\' (a decoder reranker, Qwen3-Reranker\'s)',
    )  # fmt: skip
    return parser


def add_server_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the server's options to `parser` (the model is the caller's: `--model`, or
    `pyengine serve`'s first argument), the engine's among them (add_engine_arguments)."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key", action="append", default=None,
        help="clients must send one of these as a Bearer token (repeat it for several)",
    )  # fmt: skip
    parser.add_argument(
        "--api-key-file", default=None, help="a file of API keys, one a line (with --api-key's)"
    )
    parser.add_argument(
        "--cache-salt-per-api-key", action=argparse.BooleanOptionalAction, default=None,
        help="each API key's requests share prefix-cache blocks only among themselves "
        "(a salt of the key's replaces any cache_salt a request sends; default: on with "
        "several keys)",
    )  # fmt: skip
    parser.add_argument(
        "--public-metrics", action="store_true",
        help="/metrics answers without an API key (it shows adapter names and traffic)",
    )  # fmt: skip
    parser.add_argument(
        "--served-model-name", nargs="+", default=None, help="names clients use (default: MODEL)"
    )
    add_engine_arguments(parser)
    parser.add_argument(
        "--engine-step-timeout", type=float, default=None, metavar="SECONDS",
        help="a step running longer is a hang: its requests end with an error, /health "
        "and new requests answer 503 until it ends (default: none)",
    )  # fmt: skip
    parser.add_argument(
        "--stream-stall-timeout", type=positive_float, default=DEFAULT_STALL_TIMEOUT,
        metavar="SECONDS",
        help="a response whose client takes no data for this long (its connection's buffers "
        "full) is ended: connection closed, requests aborted",
    )  # fmt: skip
    parser.add_argument(
        "--max-request-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
        help="a larger request body is refused (413) before it is parsed",
    )  # fmt: skip
    parser.add_argument(
        "--max-waiting-requests", type=int, default=None,
        help="requests that may wait to be scheduled (past the --max-num-seqs running); past "
        "it a new one is answered 429 with Retry-After (default: 4 x --max-num-seqs; -1: "
        "no bound)",
    )  # fmt: skip
    parser.add_argument(
        "--max-waiting-prompt-tokens", type=positive_int, default=None,
        help="their prompt tokens, likewise (at least --max-model-len: a lone prompt always "
        "fits)",
    )  # fmt: skip
    limits = RequestLimits()
    for name, what in LIMIT_OPTIONS.items():
        default = getattr(limits, name)
        parser.add_argument(
            f"--{name.replace('_', '-')}", default=default,
            type=positive_float if isinstance(default, float) else positive_int,
            help=f"the most {what} one request may give (past it: 400)",
        )  # fmt: skip
    parser.add_argument(
        "--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) served under these model names",
    )  # fmt: skip
    parser.add_argument(
        "--admin-api-key", action="append", default=None,
        help="a key that may also load and unload adapters at run time (repeat it for "
        "several; each unloads only what it loaded)",
    )  # fmt: skip
    parser.add_argument(
        "--lora-root", default=None, metavar="DIR",
        help="adapters loaded at run time must lie inside this folder (links resolved)",
    )  # fmt: skip
    parser.add_argument(
        "--max-lora-adapters", type=positive_int, default=64,
        help="adapters served at once (the command line's and those loaded at run time)",
    )  # fmt: skip
    parser.add_argument("--chat-template", default=None, help="a Jinja template file (or text)")
    parser.add_argument(
        "--allowed-origins", nargs="+", default=[],
        help="origins a browser may call the server from (CORS; default: none, '*' any)",
    )  # fmt: skip
    parser.add_argument(
        "--allowed-hosts", nargs="+", default=[],
        help="without an API key, Host header names answered besides localhost and IP "
        "addresses (others are refused: DNS rebinding)",
    )  # fmt: skip
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests bring their own chat_template (a program the server runs)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help='"auto" tool choice: the model decides whether to call a tool, its calls found '
        "in its text by --tool-call-parser",
    )  # fmt: skip
    parser.add_argument(
        "--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
        help="the format the model writes its calls in (its chat template's)",
    )  # fmt: skip
    parser.add_argument(
        "--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
        help="a thinking model's format: its reasoning goes to reasoning_content, apart "
        "from the answer; a structured output constrains the answer after it, and "
        "max_thinking_tokens (or reasoning_effort) bounds it",
    )  # fmt: skip
    parser.add_argument(
        "--structured-outputs-in-reasoning", action="store_true",
        help="with --reasoning-parser: a structured output constrains the reasoning too "
        "(vLLM's enable_in_reasoning), from the answer's first token",
    )  # fmt: skip
    parser.add_argument(
        "--uvicorn-log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds Ctrl-C or SIGTERM waits for in-flight requests before aborting them",
    )
    return parser


def positive_int(text: str) -> int:
    """A command-line option's integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """A command-line option's number above 0."""
    value = float(text)
    if not value > 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def json_object(text: str) -> dict[str, object]:
    """A command-line option's JSON object (argparse reports the error by name)."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


# The server options of RequestLimits' fields (limits.py), and what each bounds.
LIMIT_OPTIONS = {
    "max_stop_strings": "stop strings",
    "max_stop_string_chars": "characters of stop strings, together,",
    "max_stop_token_ids": "distinct stop_token_ids",
    "max_logit_bias": "logit_bias entries",
    "max_output_entries": "output entries (n x max_tokens x (logprobs + 1), over its prompts)",
    "grammar_compile_timeout": "seconds its structured output's grammar takes to compile",
}


def waiting_bound(ns: argparse.Namespace, max_num_seqs: int) -> WaitingBound:
    """--max-waiting-requests' bound (by default 4 x max_num_seqs: a public server's queue
    is bounded; -1: none) and --max-waiting-prompt-tokens', past max_num_seqs running."""
    requests = ns.max_waiting_requests
    if requests is None:
        requests = 4 * max_num_seqs
    elif requests == -1:
        requests = None
    elif requests < 1:
        raise ValueError(f"--max-waiting-requests must be -1 or at least 1, got {requests}")
    return WaitingBound(requests, ns.max_waiting_prompt_tokens, running_slots=max_num_seqs)


def request_limits(ns: argparse.Namespace) -> RequestLimits:
    return RequestLimits(**{name: getattr(ns, name) for name in LIMIT_OPTIONS})


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    """The EngineArgs fields from the parsed command line (the options share their names)."""
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in fields(EngineArgs)})


def read_chat_template(value: str | None) -> str | None:
    """--chat-template's template: a file's text, or the option's own text where it is
    a Jinja template."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value  # the template itself
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


API_KEY_VARIABLE = "PYENGINE_API_KEY"  # (vLLM's is VLLM_API_KEY)
ADMIN_KEY_VARIABLE = "PYENGINE_ADMIN_API_KEY"


def api_keys(ns: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> list[str]:
    """--api-key's keys, then --api-key-file's (one a line; blank lines skipped), then
    PYENGINE_API_KEY's. An empty key, an empty or missing file, or an empty variable is
    refused: each says the operator meant the server closed, and would leave it open (or
    let in an empty bearer)."""
    keys = _non_empty(ns.api_key, "--api-key")
    if ns.api_key_file is not None:
        try:
            lines = Path(ns.api_key_file).read_text().splitlines()
        except OSError as error:
            raise ValueError(f"--api-key-file {ns.api_key_file}: {error.strerror}") from None
        from_file = [line.strip() for line in lines if line.strip()]
        if not from_file:
            raise ValueError(
                f"--api-key-file {ns.api_key_file} holds no key: the server would take "
                "every request"
            )
        keys += from_file
    return keys + _variable_key(API_KEY_VARIABLE, environ)


def admin_api_keys(ns: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> list[str]:
    """--admin-api-key's keys, then PYENGINE_ADMIN_API_KEY's: keys that may also load and
    unload adapters at run time (refused empty, as api_keys)."""
    return _non_empty(ns.admin_api_key, "--admin-api-key") + _variable_key(
        ADMIN_KEY_VARIABLE, environ
    )


def _non_empty(keys: list[str] | None, option: str) -> list[str]:
    if any(not key.strip() for key in keys or []):
        raise ValueError(f"{option}: a key is empty (it would let in an empty bearer)")
    return list(keys or [])


def _variable_key(name: str, environ: Mapping[str, str]) -> list[str]:
    if name not in environ:
        return []
    key = environ[name].strip()
    if not key:
        raise ValueError(f"{name} is set and empty: the server would take every request")
    return [key]


def auto_tool_parser(ns: argparse.Namespace) -> ToolParser | None:
    """The parser that finds "auto" tool choice's calls (None: "auto" is refused)."""
    if not ns.enable_auto_tool_choice:
        return None
    if ns.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return tool_parser(ns.tool_call_parser)
