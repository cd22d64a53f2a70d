"""POST /v1/completions: text or token-id prompts (one or many), whole or streamed; or,
with use_beam_search, each prompt's n best beams. Streamed, best_of's ranked samples
and the beams come at the end, a chunk each."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, cast

from pyengine.engine.async_engine import RequestStream
from pyengine.entrypoints.beam_search import BeamSearch, BeamSearchParams
from pyengine.entrypoints.openai.errors import APIError
from pyengine.entrypoints.openai.protocol import CompletionRequest, prompt_logprobs_json
from pyengine.entrypoints.openai.serving import (
    SSE_DONE,
    Choice,
    EncodedPrompt,
    OpenAIServing,
    PromptResult,
    envelope,
    merge,
    random_id,
    sse,
    usage,
)
from pyengine.outputs import PositionLogprobs
from pyengine.sampling_params import SamplingParams


class CompletionLogprobs:
    """The completions API's logprobs object, built token by token."""

    def __init__(self, text_offset: int = 0) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self.next_offset = text_offset

    def add(self, token_text: str, chosen: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(token_text)
        self.token_logprobs.append(chosen)
        self.top_logprobs.append(top)
        self.text_offset.append(self.next_offset)
        self.next_offset += len(token_text)

    def add_positions(
        self,
        token_ids: list[int],
        positions: Sequence[PositionLogprobs] | Sequence[PositionLogprobs | None],
        token_text: Any,
    ) -> None:
        for token, position in zip(token_ids, positions, strict=True):
            if position is None:  # the prompt's first token
                self.add(token_text(token), None, None)
                continue
            chosen = position[token]
            top = {(lp.decoded_token or ""): lp.logprob for lp in position.values()}
            self.add(chosen.decoded_token or token_text(token), chosen.logprob, top)

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def _summed_logprob(choice: Choice) -> float:
    pairs = zip(choice.token_ids, choice.logprobs, strict=True)
    return sum(position[token].logprob for token, position in pairs)


class CompletionServing(OpenAIServing):
    def prompts(self, request: CompletionRequest) -> list[EncodedPrompt]:
        p = request.prompt
        if isinstance(p, str):
            texts: list[str] | None = [p]
        elif p and all(isinstance(x, str) for x in p):
            texts = list(p)  # type: ignore[arg-type]
        else:
            texts = None
        if texts is not None:
            self.check_fan_out(len(texts), request.n)  # (before tokenizing them all)
            return [(t, self.encode(t, "prompt")) for t in texts]
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        # (The engine checks the ids as it queues them.)
        id_lists = cast(list[list[int]], [p] if isinstance(p[0], int) else p)
        return [(None, ids) for ids in id_lists]

    async def create(
        self, request: CompletionRequest
    ) -> dict[str, Any] | tuple[AsyncIterator[str], list[RequestStream]]:
        model = self.check_model(request.model)
        if request.use_beam_search:
            return await self._beam_search(request, model)
        params = request.to_sampling_params()
        await self.compile_grammar(params.structured_outputs, request.constraint_param)
        # Off the event loop: a long prompt's tokenization would hold up every stream.
        prompts = await asyncio.to_thread(self.prompts, request)
        request_id = random_id("cmpl")
        streams = await self.start(
            prompts, params, request_id, lora_request=self.adapter(request.model),
            priority=request.priority, cache_salt=request.cache_salt,
        )  # fmt: skip
        if request.stream and params.n == request.n:
            return self._stream(request, model, request_id, prompts, streams), streams
        whole = self._whole(request, model, request_id, prompts, streams, params.n)
        if request.stream:  # (best_of: the best are known at the end)
            return _streamed_whole(request, whole), streams
        return await whole

    async def _whole(
        self,
        request: CompletionRequest,
        model: str,
        request_id: str,
        prompts: list[EncodedPrompt],
        streams: list[RequestStream],
        samples: int,
    ) -> dict[str, Any]:
        """The text_completion object once the requests end; of `samples` samples a
        prompt (best_of), its n most likely."""
        results = await self.collect(prompts, streams, samples)
        if samples > request.n:  # (best_of: each prompt's n most likely samples)
            for result in results:
                result.choices = sorted(result.choices, key=_summed_logprob, reverse=True)
                del result.choices[request.n :]
        # (off the event loop: long answers' logprobs take a while)
        return await asyncio.to_thread(self._response, request, model, request_id, results)

    async def _beam_search(
        self, request: CompletionRequest, model: str
    ) -> dict[str, Any] | tuple[AsyncIterator[str], list[RequestStream]]:
        """Each prompt's n best beams as its choices: the search's steps run through the
        engine as requests of one token each (the beams' prefixes from its cache). A
        stream sends them at the end, each choice in a chunk (as vLLM's)."""
        for name in ("echo", "logprobs", "suffix"):
            if getattr(request, name):
                raise APIError(f"use_beam_search does not take {name}", param=name)
        try:
            params = BeamSearchParams(request.n, request.max_tokens or 16, request.ignore_eos,
                                      request.length_penalty)  # fmt: skip
        except ValueError as error:
            message = str(error).removeprefix("BeamSearchParams.")
            field = message.partition(" ")[0]  # (the request's name of the faulty field)
            param = {"beam_width": "n"}.get(field, field)
            raise APIError(message.replace("beam_width", "n", 1), param=param) from None
        prompts = await asyncio.to_thread(self.prompts, request)
        for prompt in prompts:  # (refused now, not in a stream)
            self.check_length(prompt, SamplingParams(max_tokens=params.max_tokens), "prompt")
        eos = (self.engine.model_config.eos_token_ids or (None,))[0]
        search, request_id = BeamSearch([ids for _, ids in prompts], params, eos), random_id("cmpl")
        # The first step is queued now: what the engine refuses (token ids, priority, a
        # salt, a full queue) is a 400, before any stream has begun.
        first = await self._beam_step(search, request, request_id)
        beams = self._beams(request, model, prompts, search, request_id, first)
        if request.stream:
            return _streamed_whole(request, beams), first[1]  # (later steps close with it)
        return await beams

    async def _beam_step(
        self, search: BeamSearch, request: CompletionRequest, request_id: str
    ) -> tuple[list[EncodedPrompt], list[RequestStream]]:
        """The search's next step queued: its beams' one-token requests, and their streams."""
        steps: list[EncodedPrompt] = [(None, ids) for ids in search.step_prompts()]
        streams = await self.start(
            steps, search.step_params, f"{request_id}-{search.steps}",
            lora_request=self.adapter(request.model), priority=request.priority,
            cache_salt=request.cache_salt,
        )  # fmt: skip
        return steps, streams

    async def _beams(
        self,
        request: CompletionRequest,
        model: str,
        prompts: list[EncodedPrompt],
        search: BeamSearch,
        request_id: str,
        first: tuple[list[EncodedPrompt], list[RequestStream]],
    ) -> dict[str, Any]:
        step: tuple[list[EncodedPrompt], list[RequestStream]] | None = first
        while not search.done:
            steps, streams = step or await self._beam_step(search, request, request_id)
            step = None
            results = await self.collect(steps, streams, 1)
            search.advance([(r.choices[0].logprobs or [{}])[0] for r in results])
        outputs = await asyncio.to_thread(search.results, self.tokenizer.decode)
        choices = [
            {"index": i * request.n + j, "text": beam.text, "logprobs": None,
             "finish_reason": "stop" if beam.finished else "length", "stop_reason": None}
            for i, output in enumerate(outputs) for j, beam in enumerate(output.sequences)
        ]  # fmt: skip
        generated = sum(len(b.tokens) for output in outputs for b in output.sequences)
        counted = usage(sum(len(ids) for _, ids in prompts), generated, 0)
        return envelope(request_id, "text_completion", int(time.time()), model, choices,
                        usage=counted)  # fmt: skip

    def _echo_text(self, prompt: EncodedPrompt) -> str:
        text, ids = prompt
        return text if text is not None else self.tokenizer.decode(ids, False)

    def _response(
        self, request: CompletionRequest, model: str, request_id: str, results: list[PromptResult]
    ) -> dict[str, Any]:
        choices = []
        for i, result in enumerate(results):
            echo = self._echo_text(result.prompt) if request.echo else ""
            for k, c in enumerate(result.choices):
                logprobs = None
                if request.logprobs is not None:
                    lp = CompletionLogprobs()
                    if request.echo and result.prompt_logprobs is not None:
                        lp.add_positions(
                            result.prompt[1], result.prompt_logprobs, self.tokenizer.token_text
                        )
                    lp.add_positions(c.token_ids, c.logprobs, self.tokenizer.token_text)
                    logprobs = lp.to_json()
                choices.append(
                    {
                        "index": i * len(result.choices) + k,
                        "text": echo + c.text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
                if request.prompt_logprobs is not None:
                    choices[-1]["prompt_logprobs"] = prompt_logprobs_json(
                        result.prompt[1], result.prompt_logprobs
                    )
        return envelope(
            request_id, "text_completion", int(time.time()), model, choices,
            usage=self.usage(results),
        )  # fmt: skip

    async def _stream(
        self,
        request: CompletionRequest,
        model: str,
        request_id: str,
        prompts: list[EncodedPrompt],
        streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        n = request.n
        created = int(time.time())
        echoed: set[int] = set()
        prompt_sent: set[int] = set()
        offsets: dict[int, int] = {}  # text_offset of each choice's next token
        completion_tokens = 0
        cached: dict[int, int] = {}  # by prompt
        prompt_positions: dict[int, list[PositionLogprobs | None]] = {}  # by prompt
        async for i, delta in merge(streams):
            cached[i] = delta.num_cached_tokens
            if delta.prompt_logprobs is not None:  # (the prompt's first delta has them)
                prompt_positions[i] = delta.prompt_logprobs
            for d in delta.outputs:
                index = i * n + d.index
                text = d.text
                lp = CompletionLogprobs(offsets.get(index, 0))
                if request.echo and index not in echoed:
                    echoed.add(index)
                    text = self._echo_text(prompts[i]) + text
                    if delta.prompt_logprobs is not None and request.logprobs is not None:
                        lp.add_positions(
                            prompts[i][1], delta.prompt_logprobs, self.tokenizer.token_text
                        )
                if d.logprobs is not None:
                    lp.add_positions(d.token_ids, d.logprobs, self.tokenizer.token_text)
                offsets[index] = lp.next_offset
                completion_tokens += len(d.token_ids)
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": lp.to_json() if request.logprobs is not None else None,
                    "finish_reason": d.finish_reason,
                    "stop_reason": d.stop_reason,
                }
                if request.prompt_logprobs is not None and index not in prompt_sent:
                    prompt_sent.add(index)  # (in each choice's first chunk, as whole)
                    choice["prompt_logprobs"] = prompt_logprobs_json(
                        prompts[i][1], prompt_positions.get(i)
                    )
                yield sse(envelope(request_id, "text_completion", created, model, [choice]))
        if request.include_usage:
            prompt_tokens = sum(len(ids) for _, ids in prompts)
            total = usage(prompt_tokens, completion_tokens, sum(cached.values()))
            yield sse(envelope(request_id, "text_completion", created, model, [], usage=total))
        yield SSE_DONE


async def _streamed_whole(
    request: CompletionRequest, whole: Coroutine[Any, Any, dict[str, Any]]
) -> AsyncIterator[str]:
    """A completion known only at its end (best_of's ranking, beam search) as a stream:
    each choice in a chunk, then the usage where asked for."""
    response = await whole
    for choice in response["choices"]:
        yield sse(envelope(response["id"], "text_completion", response["created"],
                           response["model"], [choice]))  # fmt: skip
    if request.include_usage:
        yield sse(envelope(response["id"], "text_completion", response["created"],
                           response["model"], [], usage=response["usage"]))  # fmt: skip
    yield SSE_DONE
