"""Logprobs of chosen tokens and of each row's most likely ones, ranked on the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pyengine.outputs import Logprob, PositionLogprobs
from pyengine.sample.common import column


def gather_logprobs(
    logprobs: torch.Tensor, chosen: Sequence[int], ks: Sequence[int]
) -> list[PositionLogprobs]:
    """Per row of logprobs [rows, vocab]: the chosen token's logprob and rank, and the
    ks[row] most likely tokens'. Batched on the logprobs' device: only [rows, 2 + 2k]
    numbers come back to the host, not the rows themselves (a GPU batch of 256 rows of a
    128k vocabulary would send 131 MB, then rank them row by row on the host)."""
    device, vocab = logprobs.device, logprobs.shape[-1]
    chosen_values = logprobs.gather(1, column(chosen, torch.long, device)[:, None])
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
