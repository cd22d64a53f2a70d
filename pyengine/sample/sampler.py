"""The sampler: a pipeline of logits processors (penalties, bias, blocked tokens), then
token selection (temperature, top-k / top-p / min-p, seeded sampling), over the logits
rows of one step, and the logprobs of what it chose. Every step is one batch
of tensor ops on the logits' device (a GPU's logits never leave it but as token ids);
only a seeded row's uniform number is its own, a hash of its seed and its place."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

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


@dataclass
class Redraws:
    """What drawing a step's checked rows again needs (Sampler.redraw): their rows, their
    logits as the processors left them, and the model's own (for logprobs)."""

    rows: list[SamplingRow]
    index: dict[int, int]  # the step's row -> its place here
    processed: torch.Tensor  # float32 [len(rows), vocab]
    logits: torch.Tensor  # float32 [len(rows), vocab]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row, where the request asked for them; None where no row did.
    logprobs: list[PositionLogprobs | None] | None
    # Where rows were checked: what drawing some of them again needs.
    redraws: Redraws | None = None


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
        self, logits: torch.Tensor, rows: list[SamplingRow], checked: Sequence[int] = ()
    ) -> SamplerOutput:
        """logits [rows, vocab] on the sampler's device, any float dtype. `checked`: rows
        of a structured output drawn without their mask, whose grammar is asked about the
        token afterwards: where it refuses it, redraw() draws the row again under the
        mask. A greedy row gets the argmax of its allowed tokens either way; a sampled
        row (temperature alone: no top-k, top-p or min-p) keeps an allowed draw and draws
        a refused one again, which is rejection sampling of the masked distribution."""
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        if all(_plain_greedy(r) for r in rows) and not want_logprobs and not checked:
            return self.argmax(logits)
        logits = logits.float()
        processed = logits.clone()
        for process in self.processors:
            process(processed, rows)
        chosen = self.select(processed, rows).tolist()  # (it leaves the logits as they are)
        redraws = None
        if checked:
            index = torch.tensor(list(checked), device=logits.device)
            redraws = Redraws([rows[i] for i in checked], {i: k for k, i in enumerate(checked)},
                              processed[index], logits[index])  # fmt: skip
        return SamplerOutput(chosen, self._logprobs(logits, rows, chosen), redraws)

    def redraw(self, redraws: Redraws, rows: list[int], masks: np.ndarray) -> SamplerOutput:
        """The tokens of checked `rows` (of the step) drawn again under their masks
        (`masks`: one bitmask each), a seeded row's from its second number."""
        places = [redraws.index[i] for i in rows]
        again = [replace(redraws.rows[k], allowed_tokens=masks[n], draw=1)
                 for n, k in enumerate(places)]  # fmt: skip
        index = torch.tensor(places, device=redraws.processed.device)
        processed = redraws.processed[index]
        mask_disallowed_tokens(processed, again)
        chosen = self.select(processed, again).tolist()
        return SamplerOutput(chosen, self._logprobs(redraws.logits[index], again, chosen))

    def argmax(self, logits: torch.Tensor) -> SamplerOutput:
        """Rows of plain greedy requests that want no logprobs: one argmax on the device."""
        return SamplerOutput(row_argmax(logits).tolist(), None)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, rows: list[SamplingRow], chosen: list[int]
    ) -> list[PositionLogprobs | None] | None:
        """Logprobs of the model's own distribution (float32 `logits`, before penalties
        and temperature) for the rows that ask for them; None where none does."""
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not wanted:
            return None
        entries = gather_logprobs(
            torch.log_softmax(logits[wanted], dim=-1),
            [chosen[i] for i in wanted],
            [rows[i].params.logprobs or 0 for i in wanted],
        )
        per_row: list[PositionLogprobs | None] = [None] * len(rows)
        for i, entry in zip(wanted, entries, strict=True):
            per_row[i] = entry
        return per_row


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
        and not params.allowed_token_ids
        and not params.bad_words_token_ids
    )


def _plain_greedy(row: SamplingRow) -> bool:
    plain = plain_greedy(row.params) and row.allowed_tokens is None
    return plain and not len(row.blocked_token_ids)
