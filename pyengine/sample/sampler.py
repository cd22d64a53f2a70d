"""The sampler: penalties, temperature, top-k / top-p / min-p and seeded sampling, over
the logits rows of one step, and the logprobs of what it chose. Every step is one batch
of tensor ops on the logits' device (a GPU's logits never leave it but as token ids);
only a seeded row draws its uniform number alone, from its own generator."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from pyengine.outputs import Logprob, PositionLogprobs
from pyengine.sampling_params import GREEDY_BELOW_TEMPERATURE, SamplingParams


@dataclass
class SamplingRow:
    """One logits row: the request (or sample) it belongs to and what it has so far."""

    params: SamplingParams
    prompt_token_ids: Sequence[int] | np.ndarray  # the engine's: its int array, made once
    output_token_ids: Sequence[int]
    # Seeded requests draw only from their own, a CPU generator wherever the logits are:
    # one draw a step, a few microseconds on the host against a kernel launch and a copy
    # on a GPU, and the same numbers on either.
    generator: torch.Generator | None
    blocked_token_ids: tuple[int, ...] = ()  # EOS and stop tokens while under min_tokens


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row, where the request asked for them; None where no row did.
    logprobs: list[PositionLogprobs | None] | None


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, the first where several tie (NaN counts as
    the largest, as in torch.argmax). On the CPU through numpy's argmax: for 32 rows of a
    49k vocabulary, 0.4 ms against torch's 2.2 (a decode step of the throughput bench runs
    about 80 ms)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def _column(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row parameters as a tensor on the logits' device."""
    return torch.tensor(values, dtype=dtype).to(device)


def _token_pairs(
    tokens: Sequence[Sequence[int] | np.ndarray], vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    """(i, token) of every token inside the vocabulary in each sequence i, repeats kept:
    host arrays built without a Python loop over the tokens (256 rows of 768 tokens, a
    penalized decode step of the GPU throughput shape, in a few ms)."""
    flat = np.concatenate([np.zeros(0, np.int64), *(np.asarray(ts, np.int64) for ts in tokens)])
    rows = np.repeat(np.arange(len(tokens)), [len(ts) for ts in tokens])
    inside = (flat >= 0) & (flat < vocab)
    return rows[inside], flat[inside]


def _token_index(
    tokens: Sequence[Sequence[int]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """_token_pairs as index tensors on `device`, in one copy."""
    index = torch.from_numpy(np.stack(_token_pairs(tokens, vocab))).to(device)
    return index[0], index[1]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """vLLM's semantics, in place on logits [rows, vocab]: repetition over prompt and
    output tokens (divide positive logits, multiply negative ones), frequency and presence
    over output tokens. Only the tokens the rows hold are touched, by index."""
    vocab, device, dtype = logits.shape[-1], logits.device, logits.dtype

    repeated = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    counted = [
        i
        for i, row in enumerate(rows)
        if (row.params.frequency_penalty or row.params.presence_penalty) and row.output_token_ids
    ]
    outputs = {i: np.asarray(rows[i].output_token_ids, np.int64) for i in {*repeated, *counted}}
    if repeated:
        # A token seen twice is written twice, with the same value: from the logits as
        # they were, gathered before the write.
        seen = [rows[i].prompt_token_ids for i in repeated] + [outputs[i] for i in repeated]
        row, token = _token_pairs(seen, vocab)
        row %= len(repeated)  # the outputs' sequences follow the prompts'
        penalty = np.array([rows[i].params.repetition_penalty for i in repeated])[row]
        r, t = torch.from_numpy(np.stack([np.asarray(repeated)[row], token])).to(device)
        factor = torch.from_numpy(penalty).to(device, dtype)
        values = logits[r, t]
        penalized = torch.where(values > 0, values / factor, values * factor)
        # A penalty far from 1 can overflow: +inf would make the row's softmax NaN. The
        # bound stays finite divided by any temperature that is not greedy.
        bound = torch.finfo(dtype).max * GREEDY_BELOW_TEMPERATURE
        logits[r, t] = penalized.clamp_(-bound, bound)
    if counted:
        row, token = _token_pairs([outputs[i] for i in counted], vocab)
        pair, count = np.unique(row * vocab + token, return_counts=True)
        row, token = np.divmod(pair, vocab)
        frequency = np.array([rows[i].params.frequency_penalty for i in counted])[row]
        presence = np.array([rows[i].params.presence_penalty for i in counted])[row]
        r, t = torch.from_numpy(np.stack([np.asarray(counted)[row], token])).to(device)
        # Each (row, token) once: a plain subtraction by index.
        logits[r, t] -= torch.from_numpy(frequency * count + presence).to(device, dtype)


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: each row's logit_bias added to its tokens' logits (ids past the
    vocabulary, which the engine refuses, skipped)."""
    biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return
    vocab, device = logits.shape[-1], logits.device
    entries = [(i, t, b) for i, bias in biased for t, b in bias.items() if 0 <= t < vocab]
    row, token = torch.tensor([(i, t) for i, t, _ in entries], dtype=torch.long).reshape(-1, 2).T
    values = torch.tensor([b for _, _, b in entries], dtype=logits.dtype)
    logits.index_put_((row.to(device), token.to(device)), values.to(device), accumulate=True)


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
        floor = _column(min_p, logits.dtype, device)[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    by_k = [0 < k < vocab for k in top_k]
    if any(by_k):  # below the k-th largest (ties with it stay)
        largest = logits.topk(max(k for k, on in zip(top_k, by_k, strict=True) if on), dim=-1)
        k = _column([k if on else 1 for k, on in zip(top_k, by_k, strict=True)], torch.long, device)
        kth = largest.values.gather(1, (k - 1)[:, None])[:, 0]
        kth = torch.where(_column(by_k, torch.bool, device), kth, float("-inf"))
        logits = logits.masked_fill(logits < kth[:, None], float("-inf"))
    by_p = [p < 1.0 for p in top_p]
    if not any(by_p):
        return logits
    return _top_p(logits, _column(top_p, torch.float32, device), _column(by_p, torch.bool, device))


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


class Sampler:
    def __init__(self, seed: int, device: str | torch.device = "cpu") -> None:
        # For unseeded requests, on the device the logits come from.
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits [rows, vocab] on the sampler's device, any float dtype."""
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        if all(_plain_greedy(r) for r in rows) and not want_logprobs:
            return self.argmax(logits)
        logits = logits.float()
        chosen = self._choose(logits.clone(), rows)
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

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Token ids [rows] from float32 logits (modified in place)."""
        device, vocab = logits.device, logits.shape[-1]
        apply_penalties(logits, rows)
        apply_logit_bias(logits, rows)
        blocked = [i for i, r in enumerate(rows) if r.blocked_token_ids]
        if blocked:
            j, t = _token_index([list(rows[i].blocked_token_ids) for i in blocked], vocab, device)
            logits[_column(blocked, torch.long, device)[j], t] = float("-inf")
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            return row_argmax(logits)

        temperature = _column([1.0 if r.params.greedy else r.params.temperature for r in rows],
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
        shared = [i for i, r in enumerate(rows) if r.generator is None and not greedy[i]]
        if shared:
            u[shared] = torch.rand(len(shared), 1, generator=self.generator, device=device)
        seeded = [i for i, r in enumerate(rows) if r.generator is not None and not greedy[i]]
        if seeded:  # each from its own generator, on the host; one copy for them all
            draws = torch.cat([torch.rand(1, generator=rows[i].generator) for i in seeded])
            u[seeded] = draws.to(device)[:, None]
        cdf = probs.cumsum(dim=-1)
        drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=vocab - 1)
        # u * total rounded up to the total would land past the last token kept.
        sampled = torch.where(probs.gather(1, drawn) > 0, drawn, probs.argmax(-1, keepdim=True))
        sampled = sampled[:, 0]
        return torch.where(_column(greedy, torch.bool, device), row_argmax(logits), sampled)


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
    return plain_greedy(row.params) and not row.blocked_token_ids


def gather_logprobs(
    logprobs: torch.Tensor, chosen: Sequence[int], ks: Sequence[int]
) -> list[PositionLogprobs]:
    """Per row of logprobs [rows, vocab]: the chosen token's logprob and rank, and the
    ks[row] most likely tokens'. Batched on the logprobs' device: only [rows, 2 + 2k]
    numbers come back to the host, not the rows themselves (a GPU batch of 256 rows of a
    128k vocabulary would send 131 MB, then rank them row by row on the host)."""
    device, vocab = logprobs.device, logprobs.shape[-1]
    chosen_values = logprobs.gather(1, _column(chosen, torch.long, device)[:, None])
    ranks = (logprobs > chosen_values).sum(-1, keepdim=True) + 1
    k = min(max(ks, default=0), vocab)
    top = logprobs.topk(k, dim=-1)
    # One copy back; float64 holds the float32 values and the integers exactly.
    columns = (chosen_values, ranks, top.values, top.indices)
    table = torch.cat([c.double() for c in columns], dim=1)
    entries = []
    for token, k_row, row in zip(chosen, ks, table.tolist(), strict=True):
        entry: PositionLogprobs = {token: Logprob(row[0], int(row[1]))}
        for rank in range(min(k_row, k)):
            entry.setdefault(int(row[2 + k + rank]), Logprob(row[2 + rank], rank + 1))
        entries.append(entry)
    return entries
