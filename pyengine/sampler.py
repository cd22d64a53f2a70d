"""The sampler: penalties, temperature, top-k / top-p / min-p and seeded sampling, over
the logits rows of one step, and the logprobs of what it chose."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyengine.outputs import Logprob, PositionLogprobs
from pyengine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One logits row: the request (or sample) it belongs to and what it has so far."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # seeded requests draw only from their own
    blocked_token_ids: tuple[int, ...] = ()  # EOS and stop tokens while under min_tokens


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]  # per row, where the request asked for them


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    """vLLM's semantics, in place on one row: repetition over prompt and output tokens
    (divide positive logits, multiply negative ones), frequency and presence over output
    tokens."""
    p = row.params
    vocab = logits.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)))
        seen = seen[seen < vocab]
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / p.repetition_penalty, values * p.repetition_penalty
        )
    if (p.frequency_penalty or p.presence_penalty) and row.output_token_ids:
        counts = torch.bincount(torch.tensor(row.output_token_ids), minlength=vocab)[:vocab]
        logits -= p.frequency_penalty * counts.to(logits.dtype)
        logits -= p.presence_penalty * (counts > 0).to(logits.dtype)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row with the tokens outside top-k, the top-p nucleus and the min-p floor at -inf."""
    if min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = logits.sort(descending=True)
        probs = torch.softmax(ordered, dim=-1)
        outside = probs.cumsum(-1) - probs > top_p  # mass before this token already > top_p
        outside[0] = False
        logits = logits.index_put((order[outside],), torch.tensor(float("-inf")))
    return logits


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # for unseeded requests

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits [rows, vocab] on any device, any float dtype."""
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        plain_greedy = all(_plain_greedy(r) for r in rows)
        if plain_greedy and not want_logprobs:  # the common batch: one argmax, on the device
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(rows))
        # Everything else on the CPU in float32, where the requests' generators are.
        logits = logits.to("cpu", torch.float32)
        # Logprobs of the model's own distribution, before penalties and temperature.
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if plain_greedy:
            chosen = logits.argmax(dim=-1).tolist()
        else:
            adjusted = logits.clone()
            chosen = [self._sample_row(adjusted[i], row) for i, row in enumerate(rows)]
        per_row: list[PositionLogprobs | None] = []
        for i, row in enumerate(rows):
            k = row.params.logprobs
            if k is None or logprobs is None:
                per_row.append(None)
                continue
            per_row.append(top_logprobs(logprobs[i], chosen[i], k))
        return SamplerOutput(chosen, per_row)

    def _sample_row(self, logits: torch.Tensor, row: SamplingRow) -> int:
        p = row.params
        apply_penalties(logits, row)
        if row.blocked_token_ids:
            logits[list(row.blocked_token_ids)] = float("-inf")
        if p.greedy:
            return int(logits.argmax())
        logits = filter_logits(logits / p.temperature, p.top_k, p.top_p, p.min_p)
        probs = torch.softmax(logits, dim=-1)
        # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i.
        noise = torch.empty_like(probs).exponential_(generator=row.generator or self.generator)
        return int((probs / noise).argmax())


def _plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return (
        p.greedy
        and not row.blocked_token_ids
        and p.repetition_penalty == 1.0
        and not p.frequency_penalty
        and not p.presence_penalty
    )


def top_logprobs(logprobs: torch.Tensor, chosen: int, k: int) -> PositionLogprobs:
    """The chosen token's logprob and rank, and the k most likely tokens'."""
    chosen_value = float(logprobs[chosen])
    result: PositionLogprobs = {
        chosen: Logprob(chosen_value, int((logprobs > chosen_value).sum()) + 1)
    }
    if k > 0:
        values, ids = torch.topk(logprobs, k)
        for rank, (value, token) in enumerate(zip(values.tolist(), ids.tolist(), strict=True)):
            result.setdefault(int(token), Logprob(float(value), rank + 1))
    return result
