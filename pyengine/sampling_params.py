"""SamplingParams: how one request's tokens are chosen and when it stops (as vLLM's)."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass


class RequestOutputKind(enum.Enum):
    """What a request's outputs hold (vLLM's): each whole so far, each what its step
    added, or one whole output once the request finishes."""

    CUMULATIVE = 0  # every output whole: each sample's tokens, text and logprobs so far
    DELTA = 1  # what the step added (text that could begin a stop string held back)
    FINAL_ONLY = 2  # one output, whole, once the request has finished


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's): exactly one of a JSON schema (a dict
    or its text), a regular expression, a list of choices, a grammar (Lark or GBNF/EBNF),
    or any JSON object."""

    json: dict | str | None = None  # type: ignore[type-arg]
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]  # fmt: skip
        if self.json_object is True:
            given.append("json_object")
        elif self.json_object is not False:
            raise ValueError("structured_outputs.json_object must be True or False")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar and "
                f"json_object, got {', '.join(given) or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError("structured_outputs.json must be a JSON schema (a dict or its text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        choice = self.choice
        if choice is not None and not (
            isinstance(choice, list | tuple) and choice and all(isinstance(c, str) for c in choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    def constraint(self) -> tuple[str, str]:
        """(kind, text) as llguidance's grammar_from takes them, and the cache's key."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return "json", text
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json", '{"type": "object"}'


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per generated token (plus the chosen one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Added to the logits of these token ids before sampling (OpenAI's: -100 bans a
    # token, 100 all but forces it).
    logit_bias: dict[int, float] | None = None
    # A constraint on the output (JSON schema, regex, choice, grammar), vLLM's.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: only these token ids may be sampled; words never generated (each as its
    # tokens, with and without a leading space: bad_words_token_ids, which the engine
    # fills from the tokenizer); the prompt cut to its last this many tokens.
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    truncate_prompt_tokens: int | None = None
    # A thinking model's reasoning ends with these tokens (its "</think>"; the server's
    # reasoning parser sets them where the prompt leaves the model thinking): a
    # structured output constrains only what follows them, and max_thinking_tokens
    # counts the tokens before them. With max_thinking_tokens, once that many tokens of
    # reasoning are written, the end is written next (forced), and the answer follows.
    thinking_end_token_ids: list[int] | None = None
    max_thinking_tokens: int | None = None
    # What the request's outputs hold: CUMULATIVE copies every sample's whole output at
    # each step (LLMEngine.step()'s callers read them so); a stream asks for DELTA, and
    # LLM.generate for FINAL_ONLY.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first field with a bad value. The engine checks a
        request's copy again when it is added: fields can be set after construction."""
        if self.top_k == -1:
            self.top_k = 0
        stop = self.stop
        strings = isinstance(stop, list | tuple) and all(isinstance(s, str) for s in stop)
        stop_ok = (stop is None or isinstance(stop, str) or strings) and all(self.stop_strings)
        checks: list[tuple[str, bool, str]] = [
            ("n", is_int(self.n) and self.n >= 1, "an integer >= 1"),
            ("temperature", is_real(self.temperature) and self.temperature >= 0, ">= 0"),
            ("top_p", is_real(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", is_int(self.top_k) and self.top_k >= 0, "-1, 0 (all) or >= 1"),
            ("min_p", is_real(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]"),
            ("presence_penalty", is_real(self.presence_penalty)
             and -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", is_real(self.frequency_penalty)
             and -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("repetition_penalty", is_real(self.repetition_penalty)
             and self.repetition_penalty > 0, "> 0 (and finite)"),
            ("seed", self.seed is None or is_int(self.seed), "an integer or None"),
            ("max_tokens", self.max_tokens is None or (is_int(self.max_tokens)
             and self.max_tokens >= 1), "an integer >= 1 or None"),
            ("min_tokens", is_int(self.min_tokens) and self.min_tokens >= 0
             and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
             "an integer in [0, max_tokens]"),
            ("logprobs", self.logprobs is None or (is_int(self.logprobs)
             and self.logprobs >= 0), "an integer >= 0 or None"),
            ("prompt_logprobs", self.prompt_logprobs is None or (is_int(self.prompt_logprobs)
             and self.prompt_logprobs >= 0), "an integer >= 0 or None"),
            ("stop", stop_ok, "a non-empty string or a list of them"),
            ("stop_token_ids", self.stop_token_ids is None or (
             isinstance(self.stop_token_ids, list | tuple)
             and all(is_int(t) and t >= 0 for t in self.stop_token_ids)),
             "a list of token ids >= 0"),
        ]  # fmt: skip
        bias = self.logit_bias
        checks.append(("logit_bias", bias is None or isinstance(bias, dict) and all(
            is_int(t) and t >= 0 and is_real(b) and -100 <= b <= 100 for t, b in bias.items()),
            "a dict of token ids >= 0 to numbers in [-100, 100]"))  # fmt: skip
        allowed, words, word_ids = self.allowed_token_ids, self.bad_words, self.bad_words_token_ids
        checks += [
            ("allowed_token_ids", allowed is None or (isinstance(allowed, list | tuple)
             and len(allowed) > 0 and all(is_int(t) and t >= 0 for t in allowed)),
             "a non-empty list of token ids >= 0, or None"),
            ("bad_words", words is None or (isinstance(words, list | tuple)
             and all(isinstance(w, str) and w.strip() for w in words)),
             "a list of non-blank strings, or None"),
            ("bad_words_token_ids", word_ids is None or (isinstance(word_ids, list | tuple)
             and all(isinstance(ids, list | tuple) and ids and all(is_int(t) and t >= 0
                                                                   for t in ids)
                     for ids in word_ids)), "lists of token ids >= 0, or None"),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens is None
             or (is_int(self.truncate_prompt_tokens) and self.truncate_prompt_tokens >= 1),
             "an integer >= 1 or None"),
            ("thinking_end_token_ids", self.thinking_end_token_ids is None
             or (isinstance(self.thinking_end_token_ids, list | tuple)
                 and len(self.thinking_end_token_ids) > 0
                 and all(is_int(t) and t >= 0 for t in self.thinking_end_token_ids)),
             "a non-empty list of token ids >= 0, or None"),
            ("max_thinking_tokens", self.max_thinking_tokens is None
             or (is_int(self.max_thinking_tokens) and self.max_thinking_tokens >= 0
                 and self.thinking_end_token_ids is not None),
             "an integer >= 0 with thinking_end_token_ids (the end it forces), or None"),
        ]  # fmt: skip
        constraint = self.structured_outputs
        checks.append(("structured_outputs", constraint is None
                       or isinstance(constraint, StructuredOutputsParams),
                       "a StructuredOutputsParams or None"))  # fmt: skip
        checks.append(("output_kind", isinstance(self.output_kind, RequestOutputKind),
                       "a RequestOutputKind"))  # fmt: skip
        checks += [(name, isinstance(getattr(self, name), bool), "True or False")
                   for name in ("ignore_eos", "skip_special_tokens",
                                "include_stop_str_in_output")]  # fmt: skip
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(
                    f"SamplingParams.{name} must be {expected}, got {getattr(self, name)!r}"
                )

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def greedy(self) -> bool:
        # As vLLM: a temperature this small is greedy (dividing by it overflows float32).
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1


GREEDY_BELOW_TEMPERATURE = 1e-5


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """A finite number (not a bool, NaN or infinity)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
