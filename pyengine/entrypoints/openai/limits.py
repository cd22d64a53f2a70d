"""What one request may ask of the server: bounds on the work it adds to every engine step
(stop strings searched per token, stop token ids, logit_bias entries) and on what it
makes the server hold (samples, and tokens times logprobs). The engine takes any of these
from its own caller; a public server bounds them, so that one request cannot slow or
exhaust it for every other. Past a bound: a 400 naming the field."""

from __future__ import annotations

from dataclasses import dataclass

from pyengine.entrypoints.openai.errors import APIError
from pyengine.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    max_stop_strings: int = 64
    max_stop_string_chars: int = 4096  # their lengths together
    max_stop_token_ids: int = 1024  # distinct ids
    max_logit_bias: int = 1024  # entries
    # n x max_tokens x (logprobs + 1) over a request's prompts (and, echoed with
    # logprobs, the prompts' tokens x (logprobs + 1)): the tokens and logprobs it makes
    # the server hold: n=8 x 4096 tokens x 20 logprobs is 688k.
    max_output_entries: int = 2**20
    # Seconds a structured output's grammar may take to compile (in a thread of its own:
    # neither the event loop nor the engine thread waits on it).
    grammar_compile_timeout: float = 10.0

    def check_fan_out(self, num_prompts: int, n: int, max_num_seqs: int) -> None:
        """Its prompts times n: the sequences it would run at once, at most max_num_seqs
        (checked before any prompt is tokenized)."""
        if num_prompts * n > max_num_seqs:
            raise APIError(
                f"{num_prompts} prompts x n={n} is {num_prompts * n} sequences, more than "
                f"max_num_seqs ({max_num_seqs})", param="n" if num_prompts == 1 else "prompt",
            )  # fmt: skip

    def check(self, params: SamplingParams, prompt_lengths: list[int], max_model_len: int) -> None:
        """The request's stops, bias and output size against the bounds."""
        stops = params.stop_strings
        over = [
            ("stop", len(stops), self.max_stop_strings, "stop strings"),
            ("stop", sum(map(len, stops)), self.max_stop_string_chars,
             "characters of stop strings"),
            ("stop_token_ids", len(set(params.stop_token_ids or ())), self.max_stop_token_ids,
             "distinct stop_token_ids"),
            ("logit_bias", len(params.logit_bias or {}), self.max_logit_bias,
             "logit_bias entries"),
            ("max_tokens", self.output_entries(params, prompt_lengths, max_model_len),
             self.max_output_entries, "output entries (n x max_tokens x (logprobs + 1), "
             "over its prompts)"),
        ]  # fmt: skip
        for param, asked, bound, what in over:
            if asked > bound:
                raise APIError(
                    f"the request asks for {asked} {what}; the server takes at most {bound}",
                    param=param,
                )

    @staticmethod
    def output_entries(
        params: SamplingParams, prompt_lengths: list[int], max_model_len: int
    ) -> int:
        """The tokens and logprobs the request's outputs may hold (max_tokens unset: what
        max_model_len leaves after each prompt)."""
        per_token = (params.logprobs or 0) + 1
        total = 0
        for length in prompt_lengths:
            room = max_model_len - length
            tokens = room if params.max_tokens is None else min(params.max_tokens, room)
            total += params.n * max(tokens, 0) * per_token
            if params.prompt_logprobs is not None:
                total += length * (params.prompt_logprobs + 1)
        return total
