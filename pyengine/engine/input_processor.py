"""The input processor: a request as the caller gave it, checked and turned into what the
engine core schedules. Every check happens here, before the request touches the
scheduler, so that a bad request is a ValueError naming its problem and nothing else."""

from __future__ import annotations

import time
from collections.abc import Container, Sequence
from copy import copy
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pyengine.config import EngineConfig, ModelConfig
from pyengine.engine.pooling import task_of
from pyengine.engine.structured_output import GrammarCompiler
from pyengine.lora.request import LoRARequest
from pyengine.pooling_params import PoolingParams, with_token_types
from pyengine.sampling_params import RequestOutputKind, SamplingParams
from pyengine.step_values import logit_bias_arrays
from pyengine.tokenizer import PyengineTokenizer

# What the offline API takes as one prompt: text, token ids, or {"prompt": text} /
# {"prompt_token_ids": ids} (with "prompt" the text they came from, if any).
Prompt = str | list[int] | dict[str, Any]


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> None:
    """Raises ValueError naming `what` and the first entry that is not an integer token id
    in [0, vocab_size)."""
    ids = np.asarray(token_ids)
    if ids.ndim == 1 and ids.dtype.kind in "iu":  # the common case, without a Python loop
        outside = (ids < 0) | (ids >= vocab_size)
        if not outside.any():
            return
        token_ids = [int(ids[outside.argmax()])]
    for t in token_ids:
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise ValueError(f"{what}: token ids must be integers, got {t!r:.40}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{what}: token id {t} is outside the vocabulary [0, {vocab_size})")


@dataclass(frozen=True)
class EngineRequest:
    """A checked request: the engine's own copy of everything it runs with."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_array: np.ndarray  # int32 [prompt_len], made once (penalties, the scheduler)
    params: SamplingParams  # a checked copy with lists of its own
    max_tokens: int  # at most what max_model_len leaves
    min_tokens: int
    eos_token_id: int | None
    stop_token_ids: list[int]  # the request's, and the model's other EOS ids, each once
    blocked_token_ids: np.ndarray  # int64: while under min_tokens, EOS and stop tokens
    logit_bias: tuple[np.ndarray, np.ndarray] | None  # its (token ids, biases), made once
    arrival_time: float
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)
    priority: int = 0  # with scheduling_policy "priority": lower first
    # Prefix-cache blocks are shared only among requests of one salt (a tenant's).
    cache_salt: str = ""
    # A pooling request's (its params then one greedy token, which only ends it)
    pooling: PoolingParams | None = None


class InputProcessor:
    """Stateless: the server's threads tokenize through it while the engine thread steps."""

    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        tokenizer: PyengineTokenizer | None,
    ) -> None:
        self.model_config = model_config
        self.config = config
        self.tokenizer = tokenizer
        # Structured outputs' grammars (compiled once each) and matchers.
        self.grammars = (
            None if tokenizer is None else GrammarCompiler(tokenizer, model_config.vocab_size)
        )

    def encode(self, text: str, what: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """The text's token ids; ValueError naming `what`. A text too long for
        max_model_len whatever its tokens is refused untokenized: tokenizing megabytes
        holds the interpreter for seconds, and every other request with it."""
        if self.tokenizer is None:
            raise ValueError("this model was loaded without a tokenizer (tokenizer=...)")
        max_model_len = self.config.max_model_len
        if len(text) > max_model_len * self.tokenizer.max_token_chars:
            raise ValueError(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your {what} has {len(text)} characters, more than that many tokens hold. "
                f"Please reduce the length of the {what}."
            )
        try:
            return self.tokenizer.encode(text, add_special_tokens)
        except ValueError as error:
            raise ValueError(f"{what}: {error}") from None

    def encode_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of one offline prompt."""
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                return self.encode_prompt(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' (a string) or 'prompt_token_ids'")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            f"a prompt must be a string, a list of token ids or a dict, got {prompt!r:.80}"
        )

    def process(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        existing: Container[str] = (),
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        output_kind: RequestOutputKind | None = None,
    ) -> EngineRequest:
        """The request, checked (its id against `existing`); ValueError naming whatever
        the engine cannot run."""
        if self.config.pooler is not None:
            raise ValueError(
                "this engine runs a pooling model (runner 'pooling'): it embeds, classifies "
                "or scores, and generates no text"
            )
        keep = getattr(params, "truncate_prompt_tokens", None)
        if isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1:
            prompt_token_ids = prompt_token_ids[-keep:]  # (its last tokens, as vLLM's)
        params = self._checked(request_id, prompt_token_ids, params, existing, output_kind)
        if params.bad_words:
            params.bad_words_token_ids = [*(params.bad_words_token_ids or []),
                                          *self._word_token_ids(params.bad_words)]  # fmt: skip
        self._check_priority(priority)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        if cache_salt is not None and not cache_salt.isascii():
            try:
                cache_salt.encode()
            except UnicodeEncodeError:  # (the scheduler takes it as UTF-8)
                raise ValueError(
                    "cache_salt is not valid Unicode (an unpaired surrogate)"
                ) from None
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError("structured_outputs needs the model's tokenizer")
            self.grammars.grammar(params.structured_outputs)  # (checked, and compiled once)
        eos, *more_eos = self.model_config.eos_token_ids or (None,)
        stop_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids += [t for t in more_eos if t is not None]
        stop_ids = list(dict.fromkeys(stop_ids))  # (repeats would cost each step)
        room = self.config.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        blocked = stop_ids + ([] if params.ignore_eos or eos is None else [eos])
        return EngineRequest(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            prompt_array=np.asarray(prompt_token_ids, dtype=np.int32),
            params=params,
            max_tokens=max_tokens,
            min_tokens=min(params.min_tokens, max_tokens),
            eos_token_id=eos,
            stop_token_ids=stop_ids,
            blocked_token_ids=np.array(blocked if params.min_tokens > 0 else [], np.int64),
            logit_bias=logit_bias_arrays(params.logit_bias) if params.logit_bias else None,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            lora_request=lora_request,
            priority=priority,
            cache_salt=cache_salt or "",
        )

    def process_pooling(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        prompt: str | None = None,
        token_type_ids: list[int] | None = None,
        arrival_time: float | None = None,
        existing: Container[str] = (),
        priority: int = 0,
    ) -> EngineRequest:
        """A pooling request, checked: one of the prompt (its token types, where it is a
        text pair's, 1 for the second text's) that runs whole and makes one token, which
        only ends it."""
        pooler = self.config.pooler
        if pooler is None:
            raise ValueError(
                "embeddings, classifications and scores need the pooling runner "
                "(runner='pooling'; this engine generates)"
            )
        if not isinstance(params, PoolingParams):
            raise ValueError(f"request {request_id!r}: {params!r:.40} is not a PoolingParams")
        params = replace(params)  # (checked again)
        self._check_priority(priority)
        task = task_of(params, pooler)
        if task != "embed" and params.dimensions is not None:
            raise ValueError(f"dimensions applies to embeddings, not to task {task!r}")
        hidden = self.model_config.hidden_size
        if task == "embed" and params.dimensions is not None and params.dimensions > hidden:
            raise ValueError(
                f"dimensions {params.dimensions} is more than the model's embedding size ({hidden})"
            )
        keep = params.truncate_prompt_tokens
        if keep is not None:  # (its first tokens: an encoder reads a text from its start)
            prompt_token_ids = prompt_token_ids[:keep]
            token_type_ids = None if token_type_ids is None else token_type_ids[:keep]
        sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self._checked(request_id, prompt_token_ids, sampling, existing, allow_full=True)
        # The scheduler's ids carry the types (only an encoder with a second type reads
        # them; a decoder reads the ids alone); the request's own are the plain ones.
        scheduled = prompt_token_ids
        if token_type_ids is not None and self._takes_token_types:
            scheduled = with_token_types(prompt_token_ids, token_type_ids)
        return EngineRequest(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            prompt_array=np.asarray(scheduled, dtype=np.int32),
            params=sampling,
            max_tokens=1,
            min_tokens=0,
            eos_token_id=None,
            stop_token_ids=[],
            blocked_token_ids=np.array([], np.int64),
            logit_bias=None,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            pooling=params,
        )

    @property
    def _takes_token_types(self) -> bool:
        return getattr(self.model_config.family, "type_vocab_size", 1) > 1

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """A text pair's token ids and types as the tokenizer joins them (a
        cross-encoder's query and document: [CLS] first [SEP] second [SEP] for BERT)."""
        if self.tokenizer is None:
            raise ValueError("this model was loaded without a tokenizer (tokenizer=...)")
        limit = self.config.max_model_len * self.tokenizer.max_token_chars
        if len(first) + len(second) > limit:
            raise ValueError(
                f"This model's maximum context length is {self.config.max_model_len} "
                f"tokens. However, the text pair has {len(first) + len(second)} characters, "
                "more than that many tokens hold."
            )
        try:
            return self.tokenizer.encode_pair(first, second)
        except ValueError as error:
            raise ValueError(f"text pair: {error}") from None

    def _check_priority(self, priority: object) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(
                f"priority {priority} needs scheduling_policy 'priority' (the engine "
                f"schedules {self.config.scheduling_policy!r})"
            )

    def _word_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens, at the text's start and after a space (where the
        tokenizer makes other tokens of it), each sequence once."""
        if self.tokenizer is None:
            raise ValueError("bad_words needs the model's tokenizer")
        found: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, False))
                if ids:
                    found[ids] = None
        return [list(ids) for ids in found]

    def _checked(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        existing: Container[str],
        output_kind: RequestOutputKind | None = None,
        allow_full: bool = False,
    ) -> SamplingParams:
        """The request's own copy of `params` (of `output_kind` where one is given),
        checked again (a caller may have changed its fields since it was made, or change
        them while the request runs). `allow_full`: a prompt may fill max_model_len (a
        pooling request's, which generates nothing)."""
        if not isinstance(request_id, str):
            raise ValueError(f"a request id must be a string, got {request_id!r:.40}")
        if request_id in existing:
            raise ValueError(f"request {request_id!r} already exists")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: {params!r:.40} is not a SamplingParams")
        params = replace(  # validates; the lists its own too
            params,
            stop=copy(params.stop),
            stop_token_ids=copy(params.stop_token_ids),
            logit_bias=copy(params.logit_bias),
            allowed_token_ids=copy(params.allowed_token_ids),
            bad_words=copy(params.bad_words),
            bad_words_token_ids=copy(params.bad_words_token_ids),
            thinking_end_token_ids=copy(params.thinking_end_token_ids),
            output_kind=params.output_kind if output_kind is None else output_kind,
        )
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        vocab, what = self.model_config.vocab_size, f"request {request_id!r}"
        check_token_ids(prompt_token_ids, vocab, what)
        check_token_ids(params.stop_token_ids or [], vocab, f"{what}: stop_token_ids")
        check_token_ids(list(params.logit_bias or {}), vocab, f"{what}: logit_bias")
        check_token_ids(params.allowed_token_ids or [], vocab, f"{what}: allowed_token_ids")
        check_token_ids(params.thinking_end_token_ids or [], vocab,
                        f"{what}: thinking_end_token_ids")  # fmt: skip
        for ids in params.bad_words_token_ids or []:
            check_token_ids(ids, vocab, f"{what}: bad_words_token_ids")
        c = self.config
        limits = [("logprobs", "max_logprobs", c.max_logprobs),
                  ("prompt_logprobs", "max_logprobs", c.max_logprobs),
                  ("n", "max_num_seqs", c.max_num_seqs)]  # fmt: skip
        for name, limit_name, limit in limits:
            asked = getattr(params, name)
            if asked is not None and asked > limit:
                raise ValueError(
                    f"{what}: {name} {asked} is more than {limit_name} ({limit}, an engine "
                    "argument)"
                )
        longest = c.max_model_len if allow_full else c.max_model_len - 1
        if len(prompt_token_ids) > longest:
            raise ValueError(
                f"request {request_id!r}: the prompt has {len(prompt_token_ids)} tokens; "
                f"max_model_len is {c.max_model_len}"
                + ("" if allow_full else " (prompt plus at least one token)")
            )
        return params
