"""The sampler: a pipeline of logits processors (penalties, bias, blocked tokens), then
token selection (temperature, top-k / top-p / min-p, seeded sampling), over the logits
rows of one step, and the logprobs of what it chose. Every step is one batch
of tensor ops on the logits' device (a GPU's logits never leave it but as token ids);
only a seeded row's uniform number is its own, a hash of its seed and its place."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from pyengine.outputs import PositionLogprobs
from pyengine.sample.common import row_argmax
from pyengine.sample.logits_processors import (
    DEFAULT_LOGITS_PROCESSORS,
    LogitsProcessor,
    mask_disallowed_tokens,
)
from pyengine.sample.logprobs import gather_logprobs
from pyengine.sample.token_selection import RandomSampling, TokenSelector
from pyengine.sampling_params import SamplingParams
from pyengine.step_values import SamplingRow


class GrammarCheck(Protocol):
    """Rows of a step whose structured output's mask is made only where it is needed:
    their tokens are drawn without it, and those the grammar refuses are drawn again
    under their masks. A greedy row gets the argmax of its allowed tokens either way; a
    sampled row (temperature alone: no top-k, top-p or min-p) keeps an allowed draw and
    draws a refused one again, which is rejection sampling of the masked distribution."""

    def refused(self, token_ids: list[int]) -> list[int]:
        """Of the checked rows, those whose token (one per row of the step) the grammar
        does not allow next."""
        ...

    def masks(self, rows: list[int]) -> np.ndarray:
        """The rows' bitmasks (int32 [len(rows), words], as allowed_tokens)."""
        ...


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row, where the request asked for them; None where no row did.
    logprobs: list[PositionLogprobs | None] | None


class Sampler:
    """Logits processors, then token selection, then the logprobs rows asked for."""

    def __init__(
        self,
        seed: int,
        device: str | torch.device = "cpu",
        processors: Sequence[LogitsProcessor] = DEFAULT_LOGITS_PROCESSORS,
        selector: TokenSelector | None = None,
    ) -> None:
        # For unseeded requests, on the device the logits come from.
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.processors = tuple(processors)
        self.select: TokenSelector = selector or RandomSampling(self.generator)

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], check: GrammarCheck | None = None
    ) -> SamplerOutput:
        """logits [rows, vocab] on the sampler's device, any float dtype; `check`: rows
        whose masks are made only for a token their grammar refuses."""
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        if all(_plain_greedy(r) for r in rows) and not want_logprobs and check is None:
            return self.argmax(logits)
        logits = logits.float()
        chosen = self._choose(logits.clone(), rows, check)
        if not want_logprobs:
            return SamplerOutput(chosen.tolist(), None)
        # Logprobs of the model's own distribution, before penalties and temperature.
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        chosen_ids = chosen.tolist()
        entries = gather_logprobs(
            torch.log_softmax(logits[wanted], dim=-1),
            [chosen_ids[i] for i in wanted],
            [rows[i].params.logprobs or 0 for i in wanted],
        )
        per_row: list[PositionLogprobs | None] = [None] * len(rows)
        for i, entry in zip(wanted, entries, strict=True):
            per_row[i] = entry
        return SamplerOutput(chosen_ids, per_row)

    def argmax(self, logits: torch.Tensor) -> SamplerOutput:
        """Rows of plain greedy requests that want no logprobs: one argmax on the device."""
        return SamplerOutput(row_argmax(logits).tolist(), None)

    def _choose(
        self, logits: torch.Tensor, rows: list[SamplingRow], check: GrammarCheck | None
    ) -> torch.Tensor:
        """Token ids [rows] from float32 logits (modified in place)."""
        for process in self.processors:
            process(logits, rows)
        chosen = self.select(logits, rows)
        refused = [] if check is None else check.refused(chosen.tolist())
        if refused:
            assert check is not None
            masks = check.masks(refused)
            again = [replace(rows[i], allowed_tokens=masks[k], draw=1)
                     for k, i in enumerate(refused)]  # fmt: skip
            index = torch.tensor(refused, device=logits.device)
            processed = logits[index]  # (the selector leaves the logits as they are)
            mask_disallowed_tokens(processed, again)
            chosen[index] = self.select(processed, again)
        return chosen


def heaviest_rows(num_rows: int, max_logprobs: int) -> list[SamplingRow]:
    """Rows that take the sampler's costliest paths (penalties, every filter, the top-p
    sort of whole rows where the nucleus is wide, logprobs), for measuring its memory at
    a batch of `num_rows`."""
    filtered = SamplingParams(
        temperature=0.7, top_p=0.999, top_k=50, min_p=0.01, repetition_penalty=1.1,
        frequency_penalty=0.1, presence_penalty=0.1, logprobs=max_logprobs,
    )  # fmt: skip
    wide = replace(filtered, top_k=0, min_p=0.0)  # its nucleus can pass the top 1024
    return [SamplingRow(wide if i % 2 else filtered, [0, 1, 2], [3, 3], None)
            for i in range(num_rows)]  # fmt: skip


def plain_greedy(params: SamplingParams) -> bool:
    """Whether a request's tokens are the argmax of the model's logits, unchanged (save
    the tokens it blocks while under min_tokens)."""
    return (
        params.greedy
        and params.repetition_penalty == 1.0
        and not params.frequency_penalty
        and not params.presence_penalty
        and not params.logit_bias
    )


def _plain_greedy(row: SamplingRow) -> bool:
    return plain_greedy(row.params) and not row.blocked_token_ids and row.allowed_tokens is None
