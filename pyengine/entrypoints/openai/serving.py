"""What the completions and chat endpoints share: model names, starting a request's
prompts on the engine, merging their streams, collecting whole answers, usage, SSE."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from pyengine.engine.async_engine import AsyncLLMEngine, RequestStream
from pyengine.engine.input_processor import check_token_ids
from pyengine.entrypoints.openai.admission import WaitingBound
from pyengine.entrypoints.openai.errors import APIError
from pyengine.entrypoints.openai.limits import RequestLimits
from pyengine.entrypoints.openai.served_models import ServedModels
from pyengine.flat_logprobs import FlatLogprobs
from pyengine.lora.request import LoRARequest
from pyengine.outputs import PositionLogprobs, RequestOutput
from pyengine.sampling_params import SamplingParams, StructuredOutputsParams
from pyengine.tokenizer import PyengineTokenizer

T = TypeVar("T")

# (the prompt's text if known, its token ids)
EncodedPrompt = tuple[str | None, list[int]]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def envelope(
    request_id: str, kind: str, created: int, model: str, choices: list[dict[str, Any]],
    **extra: Any,
) -> dict[str, Any]:  # fmt: skip
    """A response or stream chunk: its id, object kind, creation time, model and choices."""
    return {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
        **extra,
    }


@dataclass
class Choice:
    """One sample's whole answer, accumulated from its deltas (the text as its pieces,
    joined once read: growing one string would copy it whole at every step)."""

    text_pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: FlatLogprobs = field(default_factory=FlatLogprobs)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_pieces)


@dataclass
class PromptResult:
    prompt: EncodedPrompt
    choices: list[Choice]
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        served: ServedModels,
        chat_template: str | None,
        waiting: WaitingBound | None = None,
        limits: RequestLimits | None = None,
    ) -> None:
        self.engine = engine
        self.served = served
        self.chat_template = chat_template
        self.waiting = waiting or WaitingBound()  # (shared by the endpoints)
        self.limits = limits or RequestLimits()

    def check_model(self, model: str | None) -> str:
        """The name a response reports for `model`; 404 where nothing is served by it."""
        name, _ = self.served.resolve(model)
        return name

    def adapter(self, model: str | None) -> LoRARequest | None:
        return self.served.resolve(model)[1]

    @property
    def tokenizer(self) -> PyengineTokenizer:
        if self.engine.tokenizer is None:
            raise APIError("this model was loaded without a tokenizer", status=400)
        return self.engine.tokenizer

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        try:
            check_token_ids(token_ids, self.engine.model_config.vocab_size, param)
        except ValueError as error:
            raise APIError(str(error), param=param) from None

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids (InputProcessor.encode), its errors as 400s naming `param`."""
        try:
            return self.engine.input_processor.encode(text, param, add_special_tokens)
        except ValueError as error:
            raise APIError(str(error), param=param) from None

    # Structured outputs' grammars compile here, one at a time: a slow one holds up
    # neither the event loop nor the engine thread, only the next compile. At a lower
    # priority than the engine's kernels, whose cores it would otherwise take.
    grammar_thread = ThreadPoolExecutor(
        1, thread_name_prefix="pyengine-grammars", initializer=lambda: lower_priority(10)
    )

    def warm_up_grammars(self) -> None:
        """Has the grammar thread read the vocabulary for the grammar backend now, as the
        server starts (a fifth of a second that holds the interpreter), rather than at the
        first constrained request, beside others running."""
        grammars = self.engine.input_processor.grammars
        if grammars is not None:
            self.grammar_thread.submit(grammars.warm_up)

    async def compile_grammar(
        self, constraint: StructuredOutputsParams | None, param: str, what: str = ""
    ) -> None:
        """Compiles the constraint's grammar and its start matcher (cached: the engine
        thread then copies it), within the server's time limit; 400 naming `param` where
        it is not valid or takes too long (`what`: how the message names it)."""
        grammars = self.engine.input_processor.grammars
        if constraint is None or grammars is None:
            return  # (the engine refuses a constraint without a tokenizer)
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self.grammar_thread, grammars.grammar, constraint)
        timeout = self.limits.grammar_compile_timeout
        try:
            await asyncio.wait_for(asyncio.shield(work), timeout)
        except TimeoutError:
            raise APIError(
                f"{param}: its grammar takes more than {timeout:g} s to compile", param=param
            ) from None
        except ValueError as error:
            message = str(error)
            if what:
                message = message.replace("structured_outputs.json", what)
            raise APIError(f"{param}: {message}", param=param) from None

    def check_fan_out(self, num_prompts: int, n: int) -> None:
        self.limits.check_fan_out(num_prompts, n, self.engine.config.max_num_seqs)

    def check_length(self, prompt: EncodedPrompt, params: SamplingParams, param: str) -> None:
        """As vLLM's server: a prompt and max_tokens that together pass max_model_len are
        refused (the offline API lets generation stop there instead)."""
        max_model_len, asked = self.engine.config.max_model_len, len(prompt[1])
        completion = params.max_tokens or 0
        if asked >= max_model_len or asked + completion > max_model_len:
            raise APIError(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"you requested {asked + completion} tokens ({asked} in the {param}, "
                f"{completion} in the completion). Please reduce the length of the {param} "
                "or completion.",
                param=param if asked >= max_model_len else "max_tokens",
            )

    async def start(
        self,
        prompts: list[EncodedPrompt],
        params: SamplingParams,
        request_id: str,
        prompt_param: str = "prompt",
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> list[RequestStream]:
        """Queues every prompt (through lora_request's adapter, with the request's
        priority and cache salt), within the server's limits; if one is refused, none
        stays queued."""
        for prompt in prompts:
            self.check_length(prompt, params, prompt_param)
        self.check_fan_out(len(prompts), params.n)
        lengths = [len(ids) for _, ids in prompts]
        self.limits.check(params, lengths, self.engine.config.max_model_len)

        def add(i: int) -> Awaitable[RequestStream]:
            text, token_ids = prompts[i]
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            return self.engine.add_request(
                rid, token_ids, params, text, lora_request, priority, cache_salt
            )

        return await self.queue_all(lengths, params.n, add, ("priority", "cache_salt"))

    async def queue_all(
        self,
        lengths: list[int],
        n: int,
        add: Callable[[int], Awaitable[RequestStream]],
        params: tuple[str, ...],
        default_param: str | None = None,
    ) -> list[RequestStream]:
        """Admits prompts of these lengths (n samples each) and queues each (`add(i)`:
        its stream, which releases its admission as it starts and ends). If one is
        refused, none stays queued: a ValueError is a 400 naming the first of `params`
        that its message mentions (else default_param)."""
        admitted = self.waiting.admit(lengths, n)
        streams: list[RequestStream] = []
        try:
            for i in range(len(lengths)):
                streams.append(await add(i))
                streams[-1].on_start, streams[-1].on_end = admitted[i].started, admitted[i].ended
        except BaseException as error:
            for each in admitted:
                each.ended()
            close_all(streams)
            if not isinstance(error, ValueError):
                raise
            message = str(error)
            param = next((p for p in params if p in message), default_param)
            raise APIError(message, param=param) from None
        return streams

    async def collect(
        self, prompts: list[EncodedPrompt], streams: list[RequestStream], n: int
    ) -> list[PromptResult]:
        results = [PromptResult(p, [Choice() for _ in range(n)]) for p in prompts]
        async for i, delta in merge(streams):
            result = results[i]
            result.num_cached_tokens = delta.num_cached_tokens
            if delta.prompt_logprobs is not None:
                result.prompt_logprobs = delta.prompt_logprobs
            for d in delta.outputs:
                choice = result.choices[d.index]
                choice.text_pieces.append(d.text)
                choice.token_ids += d.token_ids
                choice.logprobs += d.logprobs or []
                choice.finish_reason, choice.stop_reason = d.finish_reason, d.stop_reason
        return results

    @staticmethod
    def usage(results: list[PromptResult]) -> dict[str, Any]:
        prompt = sum(len(r.prompt[1]) for r in results)
        completion = sum(len(c.token_ids) for r in results for c in r.choices)
        return usage(prompt, completion, sum(r.num_cached_tokens for r in results))


def lower_priority(niceness: int) -> None:
    """The calling thread's scheduling priority lowered by `niceness` (Linux sets it per
    thread; elsewhere, or where it is not allowed, nothing changes)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The deltas of all streams (of generating requests) as they come, tagged with the
    stream's index; leaving early (or failing) aborts every unfinished request."""
    try:
        if len(streams) == 1:
            async for delta in streams[0]:
                assert isinstance(delta, RequestOutput)
                yield 0, delta
            return
        pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    delta = task.result()
                except StopAsyncIteration:
                    continue
                assert isinstance(delta, RequestOutput)
                yield i, delta
                pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        close_all(streams)
        if len(streams) > 1:
            for task in pending:
                task.cancel()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Runs `work`; if the client goes away first, cancels it (its requests abort) and
    raises asyncio.CancelledError."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        # The body has been read: the next message is the disconnect. (Polling
        # request.is_disconnected() misses it while the server is not reading.)
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise asyncio.CancelledError("the client disconnected")
    return task.result()
