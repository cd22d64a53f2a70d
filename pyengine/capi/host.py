"""One engine of the C API: an AsyncLLMEngine whose requests deliver their deltas
straight from the engine thread to the C side (a Deliver function of the bridge table),
and the synchronous calls (tokenize, chat template, embed, stats) that C makes of it."""

from __future__ import annotations

import ctypes
import json
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

import numpy as np

from pyengine.capi.options import engine_args
from pyengine.engine.async_engine import AsyncLLMEngine
from pyengine.lora.request import LoRARequest
from pyengine.outputs import CompletionOutput, EngineOutput, PoolingRequestOutput, RequestOutput
from pyengine.pooling_params import PoolingParams
from pyengine.sampling_params import SamplingParams, StructuredOutputsParams

# pyengine_c.h's statuses and finish reasons (bridge.py maps exceptions to the former)
OK, INVALID_ARGUMENT, MODEL, UNSUPPORTED, ENGINE = 0, -1, -3, -6, -7
_FINISH = {None: 0, "stop": 1, "length": 2, "abort": 3}
FINISH_ERROR = 4

# deliver(request, index, tokens, n, text, len, logprobs, top_tokens, top_logprobs, top_k,
#         finish, status, request_finished, prompt_tokens): cpp/capi/bridge.h's Deliver
Deliver = Callable[..., None]

_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)} - {"output_kind"}


class CApiError(Exception):
    """A failure with the C status it maps to."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Sink:
    """A C request's deltas, handed to C on the engine thread as they come."""

    loop = None  # (the engine thread calls put and fail itself)

    def __init__(self, key: int, deliver: Deliver, top_k: int, done: Callable[[int], None]):
        self.key = key
        self.deliver = deliver
        self.top_k = top_k
        self.done = done
        self.started = False  # (the prompt's length goes with the first event only)

    def put(self, delta: EngineOutput) -> None:
        assert isinstance(delta, RequestOutput)
        prompt_tokens = 0 if self.started else len(delta.prompt_token_ids)
        self.started = True
        samples = delta.outputs or [CompletionOutput(0, "", [])]
        if delta.finished:  # (before the last event: its reader may ask for the stats)
            self.done(self.key)
        for i, sample in enumerate(samples):
            last = delta.finished and i == len(samples) - 1
            self._send(sample, last, prompt_tokens)
            prompt_tokens = 0

    def _send(self, sample: CompletionOutput, last: bool, prompt_tokens: int) -> None:
        ids = sample.token_ids
        tokens = (ctypes.c_int32 * len(ids))(*ids)
        text = sample.text.encode("utf-8", "replace")
        chosen = top_tokens = top_logprobs = None
        if sample.logprobs is not None and self.top_k >= 0 and ids:
            chosen, top_tokens, top_logprobs = _logprob_arrays(sample, self.top_k)
        self.deliver(
            self.key, sample.index, tokens, len(ids), text, len(text), chosen, top_tokens,
            top_logprobs, self.top_k if chosen is not None else 0,
            _FINISH.get(sample.finish_reason, FINISH_ERROR), OK, int(last), prompt_tokens,
        )  # fmt: skip

    def fail(self, error: BaseException) -> None:
        self.done(self.key)
        status = INVALID_ARGUMENT if isinstance(error, ValueError) else ENGINE
        text = str(error).encode("utf-8", "replace")
        self.deliver(self.key, 0, None, 0, text, len(text), None, None, None, 0,
                     FINISH_ERROR, status, 1, 0)  # fmt: skip


def _logprob_arrays(sample: CompletionOutput, top_k: int) -> tuple[Any, Any, Any]:
    """Each token's logprob, and its position's top_k tokens and logprobs by rank (-1 and
    -inf where the position has fewer)."""
    assert sample.logprobs is not None
    n = len(sample.token_ids)
    chosen = (ctypes.c_float * n)()
    top_tokens = (ctypes.c_int32 * (n * top_k))(*([-1] * (n * top_k)))
    top_logprobs = (ctypes.c_float * (n * top_k))(*([-math.inf] * (n * top_k)))
    for i, (token, position) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
        chosen[i] = position[token].logprob
        ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)
        for j, (other, logprob) in enumerate(ranked[:top_k]):
            top_tokens[i * top_k + j] = other
            top_logprobs[i * top_k + j] = logprob.logprob
    return chosen, top_tokens, top_logprobs


class _Pooled:
    """A pooling request's one output, waited for by the caller's thread."""

    loop = None

    def __init__(self) -> None:
        self.done = threading.Event()
        self.output: PoolingRequestOutput | None = None
        self.error: BaseException | None = None

    def put(self, delta: EngineOutput) -> None:
        assert isinstance(delta, PoolingRequestOutput)
        self.output = delta
        self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


class EmbeddedEngine:
    """The engine behind one pyengine_engine handle."""

    def __init__(self, model: str | None, options: Mapping[str, str], deliver: Deliver):
        args = engine_args(model, options)  # (ValueError: the caller's options)
        try:
            llm_engine = args.create_engine()
        except Exception as error:  # (the model, or what it cannot run with)
            raise CApiError(MODEL, f"{type(error).__name__}: {error}") from None
        self.engine = AsyncLLMEngine(llm_engine)
        self.engine.start()
        self.deliver = deliver
        self._live: set[int] = set()  # the keys of requests not yet finished
        self._pool_ids = iter(range(1, 1 << 62))

    @property
    def _tokenizer(self) -> Any:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise CApiError(UNSUPPORTED, "this model was loaded without a tokenizer")
        return tokenizer

    def submit(self, spec: dict[str, Any]) -> None:
        key = int(spec["request"])
        params = sampling_params(spec["sampling"], spec.get("extra"))
        text, ids = self._prompt(spec)
        lora = spec.get("lora")
        lora_request = None if lora is None else LoRARequest(lora["name"], lora["id"], lora["path"])
        top_k = -1 if params.logprobs is None else params.logprobs
        sink = _Sink(key, self.deliver, top_k, self._live.discard)
        self._live.add(key)
        try:
            self.engine.add_request_nowait(
                f"c-{key}", ids, params, sink, prompt=text, lora_request=lora_request,
                priority=spec.get("priority", 0),
            )  # fmt: skip
        except BaseException:
            self._live.discard(key)
            raise

    def _prompt(self, spec: dict[str, Any]) -> tuple[str | None, list[int]]:
        processor = self.engine.input_processor
        if "prompt_token_ids" in spec:
            return None, [int(t) for t in spec["prompt_token_ids"]]
        if "messages" in spec:
            text = self.chat_template(spec["messages"], True)
            return text, processor.encode(text, add_special_tokens=False)
        return spec["prompt"], processor.encode(spec["prompt"])

    def abort(self, key: int) -> None:
        done = self.engine.abort(f"c-{key}")
        if done is not None:
            done.result()  # (waits for the engine thread: the request's blocks are free)

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return [int(t) for t in self._tokenizer.encode(text, add_special_tokens)]

    def detokenize(self, tokens: list[int], skip_special_tokens: bool) -> str:
        return str(self._tokenizer.decode(tokens, skip_special_tokens))

    def chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return str(self._tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt
        ))  # fmt: skip

    def embed(self, texts: list[str], normalize: bool, dimensions: int | None) -> np.ndarray:
        if self.engine.config.pooler is None:
            raise CApiError(UNSUPPORTED, "embeddings need a pooling model (runner 'pooling'); "
                            "this engine generates")  # fmt: skip
        params = PoolingParams(task="embed", normalize=normalize, dimensions=dimensions)
        encoded = [self.engine.input_processor.encode(text, "text") for text in texts]
        sinks: list[_Pooled] = []
        added: list[str] = []
        try:
            for text, ids in zip(texts, encoded, strict=True):
                sinks.append(_Pooled())
                request_id = f"c-embed-{next(self._pool_ids)}"
                self.engine.add_pooling_request_nowait(request_id, ids, params, sinks[-1], text)
                added.append(request_id)
        except BaseException:
            for request_id in added:  # (nothing is left running behind the error)
                self.engine.abort(request_id)
            raise
        rows = []
        for sink in sinks:
            sink.done.wait()
            if sink.error is not None:
                raise sink.error
            assert sink.output is not None
            rows.append(sink.output.outputs.data)
        return np.asarray(rows, dtype=np.float32)

    def info(self) -> list[int]:
        model = self.engine.model_config
        eos = model.eos_token_ids or [-1]
        tokenizer = self.engine.tokenizer
        return [
            model.vocab_size, self.engine.config.max_model_len, eos[0], model.hidden_size,
            int(self.engine.config.pooler is not None),
            int(tokenizer is not None and tokenizer.chat_template is not None),
        ]  # fmt: skip

    def stats(self) -> list[float]:
        s = self.engine.stats  # (the engine thread's snapshot, taken after each step)
        return [
            s.num_running, s.num_waiting, s.num_preemptions, s.kv_cache_usage,
            s.prefix_cache_hit_rate, s.prefix_cache_queries, s.prefix_cache_hits,
            len(self._live),
        ]  # fmt: skip

    def shutdown(self) -> None:
        self.engine.stop()


def sampling_params(fields_: dict[str, Any], extra: str | None) -> SamplingParams:
    """SamplingParams of the C struct's fields, then extra_json's (by name)."""
    values = dict(fields_)
    structured = values.pop("structured_outputs")
    values["structured_outputs"] = structured or None
    values["stop"] = values["stop"] or None
    values["stop_token_ids"] = values["stop_token_ids"] or None
    if extra:
        try:
            more = json.loads(extra)
        except ValueError as error:
            raise ValueError(f"sampling.extra_json is not valid JSON: {error}") from None
        if not isinstance(more, dict):
            raise ValueError("sampling.extra_json must be a JSON object")
        unknown = sorted(set(more) - _SAMPLING_FIELDS)
        if unknown:
            raise ValueError(f"sampling.extra_json: unknown sampling parameter {unknown[0]!r}")
        if isinstance(more.get("logit_bias"), dict):
            more["logit_bias"] = {int(t): b for t, b in more["logit_bias"].items()}
        values.update(more)
    if isinstance(values["structured_outputs"], dict):
        values["structured_outputs"] = StructuredOutputsParams(**values["structured_outputs"])
    return SamplingParams(**values)
