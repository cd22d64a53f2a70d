"""Token selection: the last stage of the sampler, from processed logits to one token a
row. Greedy, temperature with top-k / top-p / min-p, seeded draws; speculative decoding
replaces this stage with rejection sampling over a row's draft tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from pyengine.sample.common import column, row_argmax, seeded_uniform

if TYPE_CHECKING:
    from pyengine.step_values import SamplingRow


class TokenSelector(Protocol):
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Token ids [rows] (int64, on the logits' device) from float32 logits, which it
        leaves as they are (a row a grammar refuses is drawn again from them)."""
        ...


class RandomSampling:
    """Greedy rows take the argmax; the others draw by inverse CDF from the filtered,
    temperature-scaled distribution: unseeded rows from the sampler's generator on the
    logits' device, seeded ones each its own number (seeded_uniform)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Token ids [rows] from processed float32 logits (left as they are)."""
        device, vocab = logits.device, logits.shape[-1]
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            return row_argmax(logits)

        temperature = column([1.0 if r.params.greedy else r.params.temperature for r in rows],
                             torch.float32, device)  # fmt: skip
        filtered = filter_logits(
            logits / temperature[:, None],
            [r.params.top_k for r in rows],
            [r.params.top_p for r in rows],
            [r.params.min_p for r in rows],
        )
        probs = torch.softmax(filtered, dim=-1)
        # Inverse CDF: the first token whose cumulative probability passes u ~ U[0, 1).
        u = torch.zeros(len(rows), 1, device=device)  # greedy rows draw nothing
        shared = [i for i, r in enumerate(rows) if r.seed is None and not greedy[i]]
        if shared:
            u[shared] = torch.rand(len(shared), 1, generator=self.generator, device=device)
        seeded = [i for i, r in enumerate(rows) if r.seed is not None and not greedy[i]]
        if seeded:  # each its own, on the host; one copy for them all
            draws = [seeded_uniform(rows[i].seed or 0, len(rows[i].output_token_ids),
                                    rows[i].draw) for i in seeded]  # fmt: skip
            u[seeded] = torch.tensor(draws, dtype=torch.float64).float().to(device)[:, None]
        cdf = probs.cumsum(dim=-1)
        drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=vocab - 1)
        # u * total rounded up to the total would land past the last token kept.
        sampled = torch.where(probs.gather(1, drawn) > 0, drawn, probs.argmax(-1, keepdim=True))
        sampled = sampled[:, 0]
        return torch.where(column(greedy, torch.bool, device), row_argmax(logits), sampled)


def filter_logits(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float], min_p: Sequence[float]
) -> torch.Tensor:
    """logits [rows, vocab] with each row's tokens outside its top-k (0: all), its top-p
    nucleus (1: all) and its min-p floor (0: none) at -inf, in that order. Which filters
    run is decided from the host's values, so that the host never waits on the device
    for it mid-step."""
    vocab, device = logits.shape[-1], logits.device
    if any(m > 0 for m in min_p):
        probs = torch.softmax(logits, dim=-1)
        floor = column(min_p, logits.dtype, device)[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    by_k = [0 < k < vocab for k in top_k]
    if any(by_k):  # below the k-th largest (ties with it stay)
        largest = logits.topk(max(k for k, on in zip(top_k, by_k, strict=True) if on), dim=-1)
        k = column([k if on else 1 for k, on in zip(top_k, by_k, strict=True)], torch.long, device)
        kth = largest.values.gather(1, (k - 1)[:, None])[:, 0]
        kth = torch.where(column(by_k, torch.bool, device), kth, float("-inf"))
        logits = logits.masked_fill(logits < kth[:, None], float("-inf"))
    by_p = [p < 1.0 for p in top_p]
    if not any(by_p):
        return logits
    return _top_p(logits, column(top_p, torch.float32, device), column(by_p, torch.bool, device))


# Tokens a top-p row looks at first, the most likely; all of them (a sort) only where the
# nucleus reaches past these.
_NUCLEUS_CANDIDATES = 1024


def _top_p(logits: torch.Tensor, top_p: torch.Tensor, by_p: torch.Tensor) -> torch.Tensor:
    """The rows of by_p with their tokens at -inf once the probability mass before them
    (most likely first) is past top_p; the other rows as they are."""
    vocab = logits.shape[-1]
    threshold = torch.where(by_p, top_p, float("inf"))[:, None]
    values, order = logits.topk(min(vocab, _NUCLEUS_CANDIDATES), dim=-1)
    probs = (values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
    before = probs.cumsum(dim=-1) - probs
    past = (before[:, -1:] + probs[:, -1:] > threshold)[:, 0]  # the rest is outside
    if values.shape[-1] < vocab and not bool((past | ~by_p).all()):
        values, order = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(values, dim=-1)
        before = probs.cumsum(dim=-1) - probs
    outside = before > threshold
    outside[:, 0] = False
    nucleus = torch.full_like(logits, float("-inf")).scatter_(
        1, order, values.masked_fill(outside, float("-inf"))
    )
    return torch.where(by_p[:, None], nucleus, logits)
