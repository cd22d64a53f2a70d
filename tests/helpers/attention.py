"""The CPU and CUDA paged-attention tests' cases and float64 reference: random queries and
K/V per request, shuffled block tables, the paged caches filled from them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest


@dataclass
class Case:
    query: np.ndarray  # [num_tokens, num_heads, head_size] float64
    keys: list[np.ndarray]  # per request [seq_len, num_kv_heads, head_size] float64
    values: list[np.ndarray]
    seq_lens: np.ndarray  # int32 [num_reqs]
    query_start_loc: np.ndarray  # int32 [num_reqs + 1]
    block_tables: np.ndarray  # int32 [num_reqs, max_blocks]
    num_blocks: int


def first_visible(position: int, window: int = 0, chunk: int = 0) -> int:
    """The first position a query at `position` sees: within its window and its chunk
    (0: none of either)."""
    first = max(0, position - window + 1) if window > 0 else 0
    return max(first, position - position % chunk) if chunk > 0 else first


def make_case(
    rng: np.random.Generator,
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
) -> Case:
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req) + 2
    num_blocks = sum(blocks_per_req) + 3
    ids = rng.permutation(num_blocks).astype(np.int32)
    tables = np.full((len(seq_lens), max_blocks), 10**6, dtype=np.int32)  # garbage past the end
    start = 0
    for i, n in enumerate(blocks_per_req):
        tables[i, :n] = ids[start : start + n]
        start += n
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return Case(
        query=rng.standard_normal((int(qsl[-1]), num_heads, head_size)),
        keys=[rng.standard_normal((s, num_kv_heads, head_size)) for s in seq_lens],
        values=[rng.standard_normal((s, num_kv_heads, head_size)) for s in seq_lens],
        seq_lens=np.array(seq_lens, dtype=np.int32),
        query_start_loc=qsl,
        block_tables=tables,
        num_blocks=num_blocks,
    )


def to_dtype(x: np.ndarray, dtype: str) -> object:
    """x as a tensor of the cache dtype (numpy, or torch for bfloat16)."""
    if dtype == "bfloat16":
        torch = pytest.importorskip("torch")
        return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16)
    return np.ascontiguousarray(x.astype(dtype))


def to_float64(t: object) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t.astype(np.float64)
    return t.float().numpy().astype(np.float64)  # type: ignore[attr-defined]


def fill_caches(case: Case, block_size: int, dtype: str) -> tuple[object, object]:
    """The paged caches: keys [blocks, kv_heads, head, block] (transposed), values
    [blocks, kv_heads, block, head]; slots no request uses hold NaN."""
    num_kv_heads, head_size = case.keys[0].shape[1:]
    key_cache = np.full((case.num_blocks, num_kv_heads, head_size, block_size), np.nan)
    value_cache = np.full((case.num_blocks, num_kv_heads, block_size, head_size), np.nan)
    for i, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        for pos in range(k.shape[0]):
            block = case.block_tables[i, pos // block_size]
            key_cache[block, :, :, pos % block_size] = k[pos]
            value_cache[block, :, pos % block_size] = v[pos]
    return to_dtype(key_cache, dtype), to_dtype(value_cache, dtype)


def reference(
    case: Case,
    query: np.ndarray,
    keys: list[np.ndarray],
    values: list[np.ndarray],
    scale: float,
    window: int,
    soft_cap: float,
    sinks: np.ndarray | None = None,
    chunk: int = 0,
) -> np.ndarray:
    """sinks: each head's sink logit, a share of the softmax with no value (or None);
    chunk: a query sees only its own chunk of that many positions (0: no chunks)."""
    out = np.zeros_like(query)
    group = query.shape[1] // keys[0].shape[1]
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        first, last = case.query_start_loc[i], case.query_start_loc[i + 1]
        seq_len = int(case.seq_lens[i])
        for j, token in enumerate(range(first, last)):
            position = seq_len - (last - first) + j
            lo = first_visible(position, window, chunk)
            for h in range(query.shape[1]):
                scores = k[lo : position + 1, h // group] @ query[token, h] * scale
                if soft_cap > 0:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                weights = np.exp(scores - scores.max())
                total = weights.sum()
                if sinks is not None:
                    total += np.exp(sinks[h] - scores.max())
                out[token, h] = weights @ v[lo : position + 1, h // group] / total
    return out


def check_output(
    case: Case,
    got: np.ndarray,
    dtype: str,
    scale: float,
    window: int,
    soft_cap: float,
    tolerance: float,
    cache_dtype: str | None = None,
    sinks: np.ndarray | None = None,
    chunk: int = 0,
) -> None:
    """Every element of `got` (float64) written and within `tolerance` of the reference,
    relative to its largest value."""
    # The reference sees the inputs as their dtypes rounded them.
    cache_dtype = cache_dtype or dtype
    query = to_float64(to_dtype(case.query, dtype))
    keys = [to_float64(to_dtype(k, cache_dtype)) for k in case.keys]
    values = [to_float64(to_dtype(v, cache_dtype)) for v in case.values]
    expected = reference(case, query, keys, values, scale, window, soft_cap, sinks, chunk)
    assert not np.isnan(got).any(), "an output element was not written"
    error = np.abs(got - expected).max() / np.abs(expected).max()
    assert error < tolerance, f"relative error {error:.2e}"


def release_unread_blocks(
    case: Case, caches: tuple[Any, Any], block_size: int, window: int, chunk: int
) -> np.ndarray:
    """The block tables as a window's KV-cache group leaves them: -1 in place of each
    request's blocks wholly before its first query's first visible position, whose
    cache contents become NaN (a kernel that read one would write NaN)."""
    tables = case.block_tables.copy()
    for i, seq_len in enumerate(case.seq_lens):
        position = int(seq_len) - int(case.query_start_loc[i + 1] - case.query_start_loc[i])
        for b in range(first_visible(position, window, chunk) // block_size):
            for cache in caches:
                cache[int(tables[i, b])] = float("nan")  # type: ignore[index]
            tables[i, b] = -1
    return tables


def causal_attention(query: Any, keys: Any, values: Any) -> Any:
    """One request's attention in float64 (torch): query [q, heads, d] the last q tokens
    of keys/values [context, kv_heads, d], query i seeing keys up to context - q + i."""
    import torch

    queries, heads, d = query.shape
    context, kv_heads, _ = keys.shape
    k, v = (w.double().repeat_interleave(heads // kv_heads, dim=1) for w in (keys, values))
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * d**-0.5
    visible = torch.arange(context)[None, :] <= (context - queries + torch.arange(queries))[:, None]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def check_float32_inputs_only(key_cache: Any, value_cache: Any, heads: int, head_size: int) -> None:
    """A cache the kernels read as float32 (fp8, int8) refuses 16-bit queries and K/V."""
    import torch

    from pyengine import ops

    query = torch.randn(1, heads, head_size)
    args = (torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), 0.125)  # fmt: skip
    with pytest.raises(ValueError, match="query must be float32"):
        ops.paged_attention(query.half(), query.half(), key_cache, value_cache, *args)
    with pytest.raises(ValueError, match="key must be float32"):
        ops.reshape_and_cache(query.half(), query.half(), key_cache, value_cache,
                              torch.zeros(1, dtype=torch.long))  # fmt: skip
