"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over one AsyncLLMEngine.

python -m pyengine.entrypoints.openai.api_server --model MODEL [options]
pyengine serve [MODEL] [options]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from pyengine.config import (
    PREEMPTION_MODES,
    QUANTIZATION_METHODS,
    QUANTIZED_ACTIVATIONS,
    SCHEDULING_POLICIES,
)
from pyengine.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineStepError,
    RequestStream,
)
from pyengine.engine.engine_args import EngineArgs
from pyengine.engine.llm_engine import LLMEngine
from pyengine.entrypoints.openai.admission import WaitingBound
from pyengine.entrypoints.openai.drain import DrainGate, DrainingServer
from pyengine.entrypoints.openai.metrics import EngineMetrics
from pyengine.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    error_response,
)
from pyengine.entrypoints.openai.served_models import ServedModels, parse_lora_modules
from pyengine.entrypoints.openai.serving import SSE_DONE, close_all, sse, unless_disconnected
from pyengine.entrypoints.openai.serving_chat import ChatServing
from pyengine.entrypoints.openai.serving_completion import CompletionServing
from pyengine.entrypoints.openai.slow_clients import (
    DEFAULT_STALL_TIMEOUT,
    REQUEST_IDS,
    StallGuard,
)
from pyengine.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser, tool_parser
from pyengine.executor import ExecutorDeadError
from pyengine.loader.resolve import DEFAULT_MODEL

logger = logging.getLogger("pyengine")

CLIENT_CLOSED = 499  # nginx's status for a client that went away before the answer
DEFAULT_MAX_BODY_BYTES = 32 * 2**20


def runtime_lora_updating() -> bool:
    """Whether /v1/load_lora_adapter and /v1/unload_lora_adapter are served (as vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING): PYENGINE_ALLOW_RUNTIME_LORA_UPDATING=1 or true."""
    value = os.environ.get("PYENGINE_ALLOW_RUNTIME_LORA_UPDATING", "")
    return value.lower() in ("1", "true")


def add_server_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = EngineArgs()
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
        "--cache-salt-per-api-key", action="store_true",
        help="each API key's requests share prefix-cache blocks only among themselves "
        "(a salt of the key's replaces any cache_salt a request sends)",
    )  # fmt: skip
    parser.add_argument(
        "--served-model-name", nargs="+", default=None, help="names clients use (default: MODEL)"
    )
    parser.add_argument("--tokenizer", default=d.tokenizer)
    parser.add_argument("--load-format", default=d.load_format)
    parser.add_argument(
        "--quantization", "-q", choices=list(QUANTIZATION_METHODS), default=d.quantization,
        help="the checkpoint's quantization (default: what its config.json says)",
    )  # fmt: skip
    parser.add_argument("--dtype", default=d.dtype, help="auto: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        help="auto: the model's dtype; bfloat16, float16, fp8 (e4m3) or int8 under float32 "
        "weights (CPU)",
    )
    parser.add_argument(
        "--quantized-activations", choices=list(QUANTIZED_ACTIVATIONS),
        default=d.quantized_activations,
        help="a decode step's activations for block-quantized CPU layers (GGUF, GPTQ/AWQ): "
        "float32 (the dequantized weights' exact product) or int8 (per block of 32, as "
        "llama.cpp: faster)",
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
        "--distributed-executor-backend", choices=["uni", "mp", "ray"],
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
        "--max-waiting-requests", type=positive_int, default=None,
        help="requests that may wait for their first token; past it a new one is answered "
        "429 with Retry-After (default: no bound)",
    )  # fmt: skip
    parser.add_argument(
        "--max-waiting-prompt-tokens", type=positive_int, default=None,
        help="their prompt tokens, likewise (at least --max-model-len: a lone prompt always "
        "fits)",
    )  # fmt: skip
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
    parser.add_argument(
        "--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) served under these model names",
    )  # fmt: skip
    parser.add_argument("--max-loras", type=int, default=d.max_loras)
    parser.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank)
    parser.add_argument("--max-cpu-loras", type=int, default=d.max_cpu_loras)
    parser.add_argument(
        "--speculative-config", type=json_object, default=None, metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        "(docs/speculative.md)",
    )  # fmt: skip
    parser.add_argument("--chat-template", default=None, help="a Jinja template file (or text)")
    parser.add_argument(
        "--allowed-origins",
        nargs="+",
        default=["*"],
        help="origins a browser may call the server from (CORS)",
    )
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
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
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


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    """The EngineArgs fields from the parsed command line (the options share their names)."""
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in fields(EngineArgs)})


def read_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value  # the template itself
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def build_app(
    engine: AsyncLLMEngine,
    served: ServedModels,
    api_key: str | Sequence[str] | None = None,
    chat_template: str | None = None,
    metrics: EngineMetrics | None = None,
    trust_request_chat_template: bool = False,
    allowed_origins: Sequence[str] = ("*",),
    auto_tool_parser: ToolParser | None = None,
    cache_salt_per_api_key: bool = False,
    waiting: WaitingBound | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The app over `engine`, which it starts and stops with its lifespan; `served` the
    names requests may give, the base model's and the adapters'; `auto_tool_parser` finds
    the calls of "auto" tool choice (None: refused)."""
    waiting = waiting or WaitingBound()
    if metrics is not None:
        metrics.watch(waiting)
    completions = CompletionServing(engine, served, chat_template, waiting)
    chat = ChatServing(engine, served, chat_template, waiting)
    chat.trust_request_chat_template = trust_request_chat_template
    chat.tool_parser = auto_tool_parser
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not engine.is_running:
            engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="pyengine", lifespan=lifespan)

    if api_key:
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        app.add_middleware(ApiKeyCheck, api_keys=keys, salt_per_key=cache_salt_per_api_key)
    elif cache_salt_per_api_key:
        raise ValueError("--cache-salt-per-api-key needs --api-key")
    # After the key check, so outside it: preflights are answered here (as vLLM's server).
    app.add_middleware(
        CORSMiddleware,
        allow_origins=allowed_origins,
        allow_methods=["*"],
        allow_headers=["*"],
    )
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)  # (outermost)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> Response:
        return error_response(APIError(str(error.detail), status=error.status_code))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> Response:
        logger.exception("a request failed")
        return error_response(APIError(f"internal error: {type(error).__name__}", status=500))

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> Response:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, error: RequestValidationError) -> Response:
        return error_response(validation_error(error))

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(ExecutorDeadError)
    async def engine_dead(_: Request, error: Exception) -> Response:
        return error_response(APIError(str(error), status=503))

    @app.exception_handler(EngineStepError)
    async def step_failed(_: Request, error: Exception) -> Response:
        return error_response(APIError(str(error), status=500))

    @app.get("/health")
    async def health() -> Response:
        healthy = await asyncio.to_thread(engine.check_health)
        return Response(status_code=200 if healthy else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        from pyengine import __version__

        return {"version": __version__}

    def model_card(name: str) -> dict[str, Any]:
        _, adapter = served.resolve(name)
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "pyengine",
            "max_model_len": engine.config.max_model_len,
            "root": served.base_name if adapter is None else adapter.lora_path,
            "parent": None if adapter is None else served.base_name,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        names = [*served.base_names, *served.adapters]
        return {"object": "list", "data": [model_card(name) for name in names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        return model_card(name)

    if runtime_lora_updating() and engine.config.lora is not None:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> dict[str, str]:
            request = served.new_adapter(body.lora_name, body.lora_path)
            try:
                await asyncio.to_thread(engine.llm_engine.adapters.check, request)
            except ValueError as error:
                raise APIError(str(error), param="lora_path") from None
            served.add(request)
            logger.info("loaded LoRA adapter %s from %s", body.lora_name, body.lora_path)
            return {"status": "ok", "lora_name": body.lora_name}

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> dict[str, str]:
            served.remove(body.lora_name)  # new requests no longer find it
            logger.info("unloaded LoRA adapter %s", body.lora_name)
            return {"status": "ok", "lora_name": body.lora_name}

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await answer(raw, completions.create(with_key_salt(body, raw)))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await answer(raw, chat.create(with_key_salt(body, raw)))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        completions.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            _, tokens = await chat.render(body.messages, None, body.add_generation_prompt)
        else:
            tokens = chat.encode(body.prompt or "", "prompt", body.add_special_tokens)
        max_model_len = engine.config.max_model_len
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        completions.check_model(body.model)
        completions.check_token_ids(body.tokens, "tokens")
        return {"prompt": chat.tokenizer.decode(body.tokens, False)}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        content = metrics.render() if metrics is not None else b""
        return Response(content, media_type=CONTENT_TYPE_LATEST)

    return app


RequestBody = TypeVar("RequestBody", CompletionRequest, ChatCompletionRequest)


def with_key_salt(body: RequestBody, raw: Request) -> RequestBody:
    """The body, its cache_salt the API key's where the server binds salts to keys."""
    salt = raw.scope.get(ApiKeyCheck.SALT)
    return body if salt is None else body.model_copy(update={"cache_salt": salt})


async def answer(raw: Request, work: Awaitable[Any]) -> Response:
    """A JSON body, or an SSE stream whose requests are aborted if it ends early."""
    try:
        result = await unless_disconnected(raw, work)
    except asyncio.CancelledError:
        return Response(status_code=CLIENT_CLOSED)
    if isinstance(result, dict):
        return JSONResponse(result)
    events, streams = result
    state = raw.scope.get("state")
    if state is not None:  # (for the log line, should the client stall)
        state[REQUEST_IDS] = [stream.request_id for stream in streams]
    return EngineStreamResponse(events, streams)


class EngineStreamResponse(StreamingResponse):
    """A stream of SSE events from engine requests, which are aborted however it ends: a
    client gone or stalled, a send that failed, or a stream that never started."""

    def __init__(self, events: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(_ending_in_an_error_event(events), media_type="text/event-stream")
        self.streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close_all(self.streams)  # (nothing to abort where they finished)


async def _ending_in_an_error_event(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream whose engine fails mid-way (a worker died) ends with the error as an
    event, then [DONE], as OpenAI's streams do: the client learns why it ended."""
    try:
        async for event in events:
            yield event
    except (EngineDeadError, ExecutorDeadError, RuntimeError) as error:
        logger.error("a stream ended by an engine failure: %s", error)
        yield sse(APIError(f"the engine failed: {error}", status=503).body())
        yield SSE_DONE


class BodySizeLimit:
    """Refuses a request body larger than max_bytes with 413, before anything parses it:
    by its Content-Length, or, for a chunked body, once what arrived passes the limit."""

    def __init__(self, app: Callable[..., Awaitable[None]], max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # (gone before its body came)
                await self.app(scope, _replaying(message, receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body"):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replaying(whole, receive), send)

    async def _refuse(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        error = APIError(f"the request body is larger than {self.max_bytes} bytes", status=413)
        await error_response(error)(scope, receive, send)


def _replaying(first: dict[str, Any], receive: Any) -> Callable[[], Awaitable[dict[str, Any]]]:
    """A receive that gives `first`, then what `receive` gives (the disconnect)."""
    given = False

    async def replay() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return first
        return await receive()  # type: ignore[no-any-return]

    return replay


class ApiKeyCheck:
    """Refuses /v1 requests without `Authorization: Bearer <key>` of one of the keys,
    compared in constant time (how long a refusal takes says nothing of a key); with
    salt_per_key, a request's scope carries its key's cache salt (SALT). A plain ASGI
    middleware: Starlette's BaseHTTPMiddleware would pass every chunk of a stream
    through a task and a memory stream of its own, costing each streamed token."""

    SALT = "pyengine.cache_salt"

    def __init__(
        self, app: Callable[..., Awaitable[None]], api_keys: Sequence[str], salt_per_key: bool
    ) -> None:
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]
        # (a salt no request can guess from another key's)
        self.salts = [hashlib.sha256(b"pyengine-salt:" + key).hexdigest() for key in self.expected]
        self.salt_per_key = salt_per_key

    def key_index(self, header: bytes) -> int | None:
        """Which key `header` gives (every key compared: the time is the same for all)."""
        matches = [hmac.compare_digest(header, key) for key in self.expected]
        return matches.index(True) if any(matches) else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] != "OPTIONS"  # a browser's CORS preflight carries no key
            and scope["path"].startswith("/v1")
        ):
            index = self.key_index(dict(scope["headers"]).get(b"authorization", b""))
            if index is None:
                response = error_response(APIError("invalid or missing API key", status=401))
                await response(scope, receive, send)
                return
            if self.salt_per_key:
                scope = {**scope, self.SALT: self.salts[index]}
        await self.app(scope, receive, send)


def validation_error(error: RequestValidationError) -> APIError:
    problems = []
    param = None
    for e in error.errors():
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            problems.append(f"malformed JSON body ({e.get('msg', '')})")
            continue
        param = param or (loc[0] if loc else None)
        problems.append(f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid')}")
    return APIError("; ".join(problems) or "invalid request", status=400, param=param)


def api_keys(ns: argparse.Namespace) -> list[str]:
    """--api-key's keys, then --api-key-file's (one a line; blank lines skipped)."""
    keys = list(ns.api_key or [])
    if ns.api_key_file is not None:
        lines = Path(ns.api_key_file).read_text().splitlines()
        keys += [line.strip() for line in lines if line.strip()]
    return keys


def auto_tool_parser(ns: argparse.Namespace) -> ToolParser | None:
    if not ns.enable_auto_tool_choice:
        return None
    if ns.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return tool_parser(ns.tool_call_parser)


def serve(ns: argparse.Namespace) -> None:
    """Loads the model, logs what it holds, and serves until Ctrl-C."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s")
    chat_template = read_chat_template(ns.chat_template)
    tool_calls = auto_tool_parser(ns)
    start = time.perf_counter()
    llm_engine = engine_args(ns).create_engine()
    c, executor = llm_engine.model_config, llm_engine.executor
    logger.info(
        "loaded %s (%s, %.1fM parameters) in %.1f s",
        ns.model,
        c.architecture,
        executor.num_parameters / 1e6,
        time.perf_counter() - start,
    )
    block = llm_engine.config.block_size
    logger.info(
        "KV cache: %d blocks of %d tokens = %d tokens (%s); max_model_len %d",
        executor.num_blocks,
        block,
        executor.num_blocks * block,
        llm_engine.config.cache_dtype,
        llm_engine.config.max_model_len,
    )
    max_len, bound = llm_engine.config.max_model_len, ns.max_waiting_prompt_tokens
    if bound is not None and bound < max_len:
        raise ValueError(
            f"--max-waiting-prompt-tokens {bound} is below max_model_len {max_len}: a "
            "prompt that long could never be admitted"
        )
    names = ns.served_model_name or [ns.model]
    served = ServedModels(names)
    if ns.lora_modules and not ns.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    for name, path in parse_lora_modules(ns.lora_modules):
        adapter = served.new_adapter(name, path)
        llm_engine.adapters.check(adapter)  # a bad adapter stops the server from starting
        served.add(adapter)
        logger.info("LoRA adapter %s from %s", name, path)
    metrics = EngineMetrics(names[0])
    engine = AsyncLLMEngine(llm_engine, metrics.on_step, ns.engine_step_timeout)
    app = build_app(
        engine,
        served,
        api_keys(ns),
        chat_template,
        metrics,
        ns.trust_request_chat_template,
        ns.allowed_origins,
        tool_calls,
        ns.cache_salt_per_api_key,
        WaitingBound(ns.max_waiting_requests, ns.max_waiting_prompt_tokens),
        ns.max_request_body_bytes,
    )
    template = chat_template or (llm_engine.tokenizer and llm_engine.tokenizer.chat_template)
    if tool_calls is not None and "tools" not in (template or ""):
        logger.warning(
            "the chat template does not render tools: the model is not told of them "
            "(give one that does with --chat-template)"
        )
    logger.info("serving %s on http://%s:%d/v1", ", ".join(names), ns.host, ns.port)
    # The first SIGTERM drains (drain.py); uvicorn then raises the signal again: that is a
    # drain done, exit 0.
    signal.signal(signal.SIGTERM, lambda *_: logger.info("drained after SIGTERM"))
    gate = DrainGate(StallGuard(app, ns.stream_stall_timeout, metrics.count_stall))
    config = uvicorn.Config(
        gate, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
        timeout_graceful_shutdown=5,  # (after the drain: connections left idle)
    )  # fmt: skip
    try:
        DrainingServer(config, gate, ns.shutdown_timeout, engine.fail_all).run()
    except KeyboardInterrupt:
        pass  # Ctrl-C's signal raised again once drained, as uvicorn.run takes it
    finally:
        if not engine.is_running:  # (else its thread still reads the scheduler)
            log_what_is_left(llm_engine)
        llm_engine.shutdown()  # no worker process outlives the server


def log_what_is_left(llm_engine: LLMEngine) -> None:
    """At exit: the requests and KV blocks the engine still holds (none, where the
    drain and the engine's stop went as they should)."""
    used = sum(s.kv_cache.stats().num_used_blocks for s in llm_engine.core.schedulers)
    unfinished = len(llm_engine.output_processor.requests)
    logger.info("stopped: %d requests unfinished, %d KV blocks in use", unfinished, used)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="pyengine's OpenAI-compatible server")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    serve(add_server_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    main()
