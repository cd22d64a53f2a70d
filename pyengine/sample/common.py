"""Host-side helpers the sampler's stages share: per-row columns and (row, token) index
pairs built without a Python loop over the tokens."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def column(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row parameters as a tensor on the logits' device."""
    return torch.tensor(values, dtype=dtype).to(device)


def token_pairs(
    tokens: Sequence[Sequence[int] | np.ndarray], vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    """(i, token) of every token inside the vocabulary in each sequence i, repeats kept:
    host arrays built without a Python loop over the tokens (256 rows of 768 tokens, a
    penalized decode step of the GPU throughput shape, in a few ms)."""
    flat = np.concatenate([np.zeros(0, np.int64), *(np.asarray(ts, np.int64) for ts in tokens)])
    rows = np.repeat(np.arange(len(tokens)), [len(ts) for ts in tokens])
    inside = (flat >= 0) & (flat < vocab)
    return rows[inside], flat[inside]


def token_index(
    tokens: Sequence[Sequence[int] | np.ndarray], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """token_pairs as index tensors on `device`, in one copy."""
    index = torch.from_numpy(np.stack(token_pairs(tokens, vocab))).to(device)
    return index[0], index[1]


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, the first where several tie (NaN counts as
    the largest, as in torch.argmax). On the CPU through numpy's argmax, several times
    faster than torch's over a decode step's rows."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers that spreads every bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, index: int, draw: int = 0) -> float:
    """A seeded request's uniform number in [0, 1) for its output token `index`: the
    SplitMix64 sequence of the seed's key, at that place. A token's draw depends on its
    place alone, so a seeded request samples the same tokens whether or not a step drew
    rows for drafts before it. `draw` 1 is the place's second number (a token drawn
    again under a grammar's mask), as far along the sequence as no token comes."""
    index += draw << 48
    key = _mix64(seed & _MASK64)
    return (_mix64((key + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64) >> 11) / 2.0**53
