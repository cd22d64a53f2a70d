"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over one AsyncLLMEngine: builds
the app from its parts (middlewares.py, errors.py, routes.py), loads the model the command
line names (cli_args.py) and serves it until a signal drains it (drain.py).

python -m pyengine.entrypoints.openai.api_server --model MODEL [options]
pyengine serve [MODEL] [options]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from pyengine.engine.async_engine import AsyncLLMEngine
from pyengine.engine.llm_engine import LLMEngine
from pyengine.entrypoints.openai.admission import WaitingBound
from pyengine.entrypoints.openai.cli_args import (
    add_server_arguments,
    admin_api_keys,
    api_keys,
    auto_tool_parser,
    engine_args,
    read_chat_template,
    request_limits,
    waiting_bound,
)
from pyengine.entrypoints.openai.drain import DrainGate, DrainingServer
from pyengine.entrypoints.openai.errors import add_exception_handlers
from pyengine.entrypoints.openai.limits import RequestLimits
from pyengine.entrypoints.openai.metrics import EngineMetrics
from pyengine.entrypoints.openai.middlewares import (
    DEFAULT_MAX_BODY_BYTES,
    Access,
    add_middlewares,
)
from pyengine.entrypoints.openai.reasoning_parsers import ReasoningParser, reasoning_parser
from pyengine.entrypoints.openai.routes import Routes
from pyengine.entrypoints.openai.served_models import ServedModels, parse_lora_modules
from pyengine.entrypoints.openai.serving_chat import ChatServing
from pyengine.entrypoints.openai.serving_completion import CompletionServing
from pyengine.entrypoints.openai.slow_clients import StallGuard
from pyengine.entrypoints.openai.tool_parsers import ToolParser
from pyengine.loader.resolve import DEFAULT_MODEL

logger = logging.getLogger("pyengine")


def build_app(
    engine: AsyncLLMEngine,
    served: ServedModels,
    access: Access | None = None,
    chat_template: str | None = None,
    metrics: EngineMetrics | None = None,
    trust_request_chat_template: bool = False,
    auto_tool_parser: ToolParser | None = None,
    reasoning_parser: ReasoningParser | None = None,
    structured_outputs_in_reasoning: bool = False,
    waiting: WaitingBound | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    limits: RequestLimits | None = None,
) -> FastAPI:
    """The app over `engine`, which it starts and stops with its lifespan; `served` the
    names requests may give, the base model's and the adapters'; `access` who may call it
    (middlewares.py); `auto_tool_parser` finds the calls of "auto" tool choice (None:
    refused); `reasoning_parser` splits a thinking model's reasoning from its answer, and
    a structured output constrains the answer after it (the reasoning too, with
    `structured_outputs_in_reasoning`)."""
    access, limits, waiting = (
        access or Access(),
        limits or RequestLimits(),
        waiting or WaitingBound(),
    )
    if metrics is not None:
        metrics.watch(waiting)
    completions = CompletionServing(engine, served, chat_template, waiting, limits)
    chat = ChatServing(engine, served, chat_template, waiting, limits)
    chat.trust_request_chat_template = trust_request_chat_template
    chat.tool_parser = auto_tool_parser
    chat.reasoning_parser = reasoning_parser
    chat.constrains_reasoning = structured_outputs_in_reasoning

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not engine.is_running:
            engine.start()
        chat.warm_up_grammars()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="pyengine", lifespan=lifespan)
    add_middlewares(app, access, max_request_body_bytes)
    add_exception_handlers(app)
    Routes(engine, served, completions, chat, metrics, access).add_to(app)
    return app


def serve(ns: argparse.Namespace) -> None:
    """Loads the model, logs what it holds, and serves until Ctrl-C or SIGTERM drains it."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s")
    access = Access(
        api_keys(ns),  # (keys that come out empty are refused before any loading)
        admin_api_keys(ns),
        ns.cache_salt_per_api_key,
        ns.public_metrics,
        ns.allowed_origins,
        ns.allowed_hosts,
        ns.lora_root,
    )
    chat_template = read_chat_template(ns.chat_template)
    tool_calls = auto_tool_parser(ns)
    llm_engine = load_engine(ns)
    max_len, bound = llm_engine.config.max_model_len, ns.max_waiting_prompt_tokens
    if bound is not None and bound < max_len:
        raise ValueError(
            f"--max-waiting-prompt-tokens {bound} is below max_model_len {max_len}: a "
            "prompt that long could never be admitted"
        )
    names = ns.served_model_name or [ns.model]
    served = served_models(names, ns, llm_engine)
    metrics = EngineMetrics(names[0])
    engine = AsyncLLMEngine(llm_engine, metrics.on_step, ns.engine_step_timeout)
    app = build_app(
        engine,
        served,
        access,
        chat_template=chat_template,
        metrics=metrics,
        trust_request_chat_template=ns.trust_request_chat_template,
        auto_tool_parser=tool_calls,
        reasoning_parser=None
        if ns.reasoning_parser is None
        else reasoning_parser(ns.reasoning_parser),
        structured_outputs_in_reasoning=ns.structured_outputs_in_reasoning,
        waiting=waiting_bound(ns, llm_engine.config.max_num_seqs),
        max_request_body_bytes=ns.max_request_body_bytes,
        limits=request_limits(ns),
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


def load_engine(ns: argparse.Namespace) -> LLMEngine:
    """The engine the options describe, its model and KV cache logged."""
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
    return llm_engine


def served_models(names: list[str], ns: argparse.Namespace, llm_engine: LLMEngine) -> ServedModels:
    """The names requests may give: the base model's, and --lora-modules' adapters, each
    checked here, so that a bad adapter stops the server from starting."""
    served = ServedModels(names, max_adapters=ns.max_lora_adapters)
    if ns.lora_modules and not ns.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    for name, path in parse_lora_modules(ns.lora_modules):
        adapter = served.new_adapter(name, path)
        llm_engine.adapters.check(adapter)
        served.add(adapter)
        logger.info("LoRA adapter %s from %s", name, path)
    return served


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
