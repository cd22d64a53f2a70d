"""The CPU kernel of DeepSeek's multi-head latent attention (the absorbed form) against a
float64 reference, over random latent caches in shuffled blocks: decode, prefill, a
chunked prefill on a cached prefix, contexts long enough to split across threads, and
the three cache dtypes, in each of its builds (the portable loops built for each
instruction set the CPU runs; AMX's tile unit for bfloat16, where the CPU has it); bad
arguments are clear errors."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from helpers.dense_isa import AMX, ISAS, pin_dense_isa, unpin_dense_isa

from pyengine import _C, built_with_cuda, ops

RANK, ROPE = 64, 32  # (DeepSeek's are 512 and 64: the tiles take multiples of 32 and 16)


@pytest.fixture(params=ISAS + (["amx"] if AMX else []))
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """The portable kernel's builds this CPU runs (generic, AVX2, AVX-512: the attention
    kernels' pin), and AMX's tiles (bfloat16 queries and cache) where the CPU has them."""
    pin_dense_isa("generic" if request.param != "amx" else "amx")
    _C.set_attention_isa(request.param if request.param != "amx" else "auto")
    yield request.param
    _C.set_attention_isa("auto")
    unpin_dense_isa()


def make(rng: np.random.Generator, seq_lens: list[int], q_lens: list[int], heads: int, bs: int,
         dtype: torch.dtype):  # type: ignore[no-untyped-def]  # fmt: skip
    d = RANK + ROPE
    per = [math.ceil(n / bs) for n in seq_lens]
    num_blocks = sum(per) + 3
    ids = rng.permutation(num_blocks)
    tables = np.full((len(seq_lens), max(per) + 1), 10**6, dtype=np.int32)
    cache = torch.full((num_blocks, bs, d), float("nan"), dtype=torch.float64)
    latents, start = [], 0
    for i, (n, k) in enumerate(zip(seq_lens, per, strict=True)):
        tables[i, :k] = ids[start : start + k]
        start += k
        latent = torch.from_numpy(rng.standard_normal((n, d)))
        latents.append(latent.to(dtype).double())
        for p in range(n):
            cache[tables[i, p // bs], p % bs] = latent[p]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = torch.from_numpy(rng.standard_normal((int(qsl[-1]), heads, d))).to(dtype)
    return cache.to(dtype), tables, np.array(seq_lens, np.int32), qsl, query, latents


def reference(query: torch.Tensor, latents: list[torch.Tensor], seq_lens: np.ndarray,
              qsl: np.ndarray, scale: float, value: int = RANK) -> torch.Tensor:  # fmt: skip
    q = query.double()
    out = torch.zeros(q.shape[0], q.shape[1], value, dtype=torch.float64)
    for i, latent in enumerate(latents):
        q_len = int(qsl[i + 1] - qsl[i])
        for j in range(q_len):
            t, position = int(qsl[i]) + j, int(seq_lens[i]) - q_len + j
            keys = latent[: position + 1]
            weights = torch.softmax(q[t] @ keys.T * scale, dim=-1)
            out[t] = weights @ keys[:, :value]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("seq_lens", "q_lens"),
    [([1, 17, 40, 300], [1, 1, 1, 1]), ([5, 33, 64], [5, 33, 64]), ([50, 120, 9], [7, 30, 9]),
     ([3000], [1]), ([1500, 900], [2, 1])],
    ids=["decode", "prefill", "chunked", "split", "split2"],
)  # fmt: skip
def test_matches_the_float64_reference(isa: str, dtype: torch.dtype, seq_lens: list[int],
                                       q_lens: list[int]) -> None:  # fmt: skip
    rng = np.random.default_rng()
    cache, tables, lens, qsl, query, latents = make(rng, seq_lens, q_lens, 8, 16, dtype)
    scale = 0.3 / math.sqrt(RANK + ROPE)
    out = torch.full((query.shape[0], 8, RANK), float("nan"), dtype=dtype)
    ops.mla_attention(out, query, cache, torch.from_numpy(tables), torch.from_numpy(lens),
                      torch.from_numpy(qsl), scale, RANK)  # fmt: skip
    want = reference(query, latents, lens, qsl, scale)
    error = ((out.double() - want).abs().max() / want.abs().max()).item()
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), error


@pytest.mark.parametrize(
    ("heads", "value"), [(1, 32), (5, 64), (16, 32), (16, 96), (20, 64), (40, 32)]
)
def test_any_head_count_and_value_width(isa: str, heads: int, value: int) -> None:
    """bfloat16, where the AMX and AVX512-BF16 builds keep a head a lane (16 at a time)
    and take the values 64 or 32 columns at a time: heads short of a whole vector, past
    one (16 and 4; 16, 16 and 8), and widths that leave 32 columns over."""
    rng = np.random.default_rng()
    cache, tables, lens, qsl, query, latents = make(
        rng, [300, 45], [1, 45], heads, 16, torch.bfloat16
    )
    out = torch.full((query.shape[0], heads, value), float("nan"), dtype=torch.bfloat16)
    ops.mla_attention(out, query, cache, torch.from_numpy(tables), torch.from_numpy(lens),
                      torch.from_numpy(qsl), 0.1, value)  # fmt: skip
    want = reference(query, latents, lens, qsl, 0.1, value)
    assert ((out.double() - want).abs().max() / want.abs().max()).item() < 1e-2


def test_float32_queries_over_a_bfloat16_cache() -> None:
    rng = np.random.default_rng(3)
    cache, tables, lens, qsl, query, latents = make(rng, [70, 5], [70, 1], 4, 16, torch.bfloat16)
    query = query.float()
    out = torch.empty(query.shape[0], 4, RANK)
    ops.mla_attention(out, query, cache, torch.from_numpy(tables), torch.from_numpy(lens),
                      torch.from_numpy(qsl), 0.1, RANK)  # fmt: skip
    want = reference(query, latents, lens, qsl, 0.1)
    assert ((out.double() - want).abs().max() / want.abs().max()).item() < 1e-5


def test_bad_arguments_are_clear_errors() -> None:
    rng = np.random.default_rng(4)
    cache, tables, lens, qsl, query, _ = make(rng, [20], [20], 4, 16, torch.float32)
    out = torch.empty(20, 4, RANK)
    args = (torch.from_numpy(tables), torch.from_numpy(lens), torch.from_numpy(qsl))
    with pytest.raises(ValueError, match="value_dim must be in"):
        ops.mla_attention(out, query, cache, *args, 0.1, RANK + ROPE + 1)
    with pytest.raises(ValueError, match="query's last dim must be the latent's"):
        ops.mla_attention(out, query[..., :RANK].contiguous(), cache, *args, 0.1, RANK)
    with pytest.raises(ValueError, match="out must be"):
        ops.mla_attention(out[..., :8].contiguous(), query, cache, *args, 0.1, RANK)
    bad = tables.copy()
    bad[0, 0] = cache.shape[0]
    with pytest.raises(ValueError, match=r"block_tables\[0, 0\]"):
        ops.mla_attention(out, query, cache, torch.from_numpy(bad), *args[1:], 0.1, RANK)
    with pytest.raises(ValueError, match="query must be float32 or the cache's dtype"):
        ops.mla_attention(out.half(), query.half(), cache.bfloat16(), *args, 0.1, RANK)


@pytest.mark.parametrize("piece", [1024, 16], ids=["whole", "pieces"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_expanded_form_matches_the_absorbed_ones_reference(
    dtype: torch.dtype, piece: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The long prefills' form: each request's latents gathered from shuffled blocks,
    expanded to per-head keys and values (in one piece, or pieces of 16 tokens), then
    causal attention, is the absorbed form's float64 result taken out of the latent space
    (a chunk on a cached prefix, and a whole prompt)."""
    from pyengine.layers import latent_attention
    from pyengine.layers.attention import AttentionMetadata

    monkeypatch.setattr(latent_attention, "EXPANDED_PIECE", piece)
    from pyengine.layers.latent_attention import (
        ExpandedWeights,
        LatentAttention,
        expanded_attention,
        expanded_head_size,
    )

    rng = np.random.default_rng()
    heads, nope, v = 4, 24, 20
    seq_lens, q_lens = [90, 37], [30, 37]
    cache, tables, lens, qsl, _, latents = make(rng, seq_lens, q_lens, heads, 16, dtype)
    w_uk = torch.from_numpy(rng.standard_normal((heads, nope, RANK))) / 4
    w_uv = torch.from_numpy(rng.standard_normal((heads, RANK, v))) / 4
    q_nope = torch.from_numpy(rng.standard_normal((int(qsl[-1]), heads, nope)))
    q_pe = torch.from_numpy(rng.standard_normal((int(qsl[-1]), heads, ROPE)))
    scale = 0.4 / math.sqrt(nope + ROPE)
    absorbed = torch.cat((torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe), dim=-1)
    want = torch.einsum("thr,hrv->thv", reference(absorbed, latents, lens, qsl, scale), w_uv)
    meta = AttentionMetadata(torch.zeros(1, 0, dtype=torch.long),
                             torch.from_numpy(tables)[None], torch.from_numpy(lens),
                             torch.from_numpy(qsl))  # fmt: skip
    attn = LatentAttention(heads, RANK, ROPE, scale)
    size = expanded_head_size(nope + ROPE, v)
    assert size == 64  # (keys of 56 and values of 20 numbers padded with zeros)
    weights = ExpandedWeights(w_uk.to(dtype), w_uv.to(dtype), scale, size)
    query = torch.cat((q_nope, q_pe), dim=-1).to(dtype)
    for r in range(len(seq_lens)):
        rows = slice(int(qsl[r]), int(qsl[r + 1]))
        got = expanded_attention(query[rows], attn.context((cache, cache), meta, r), weights)
        error = ((got.double() - want[rows]).abs().max() / want[rows].abs().max()).item()
        assert error < (1e-5 if dtype == torch.float32 else 1e-2), error


def test_the_expanded_form_starts_where_the_absorbed_build_gives_way() -> None:
    """A bfloat16 query over a bfloat16 cache takes the threshold of the build that runs
    it: AMX's tiles (never expanded), AVX512-BF16's dot products, or the portable loops,
    as the CPU has them and the pins allow, with any number of heads. Any other dtype, or
    blocks the lane builds do not take, keep the portable loops' threshold."""
    from pyengine.layers.latent_attention import EXPANDED_FROM, LatentAttention

    def cache(dtype: torch.dtype, bs: int = 16):  # type: ignore[no-untyped-def]
        latents = torch.zeros(4, bs, RANK + ROPE, dtype=dtype)
        return latents, latents

    portable = EXPANDED_FROM["portable"]
    attn, many = LatentAttention(16, RANK, ROPE, 0.1), LatentAttention(40, RANK, ROPE, 0.1)
    assert attn.expanded_from_over(cache(torch.bfloat16), torch.float32) == portable
    assert attn.expanded_from_over(cache(torch.float32), torch.float32) == portable
    assert attn.expanded_from_over(cache(torch.bfloat16, bs=8), torch.bfloat16) == portable
    dots = "avx512" in ISAS and _C.bf16_dot_product()  # (the CPU has AVX512-BF16)
    for isa in ISAS + (["amx"] if AMX else []):
        pin_dense_isa("generic" if isa != "amx" else "amx")
        _C.set_attention_isa(isa if isa != "amx" else "auto")
        try:
            build = "amx" if isa == "amx" else "avx512_bf16" if dots and isa == "avx512" else None
            for layer in (attn, many):
                got = layer.expanded_from_over(cache(torch.bfloat16), torch.bfloat16)
                assert got == EXPANDED_FROM[build or "portable"], (isa, layer.num_heads)
        finally:
            _C.set_attention_isa("auto")
            unpin_dense_isa()


def test_an_fp8_cache_is_its_e4m3_values() -> None:
    """vLLM's fp8 latent cache (e4m3 bytes as uint8, no scale) under float32 queries: the
    float64 reference over the latents rounded to e4m3; other queries refused by name."""
    rng = np.random.default_rng()
    cache, tables, lens, qsl, query, latents = make(rng, [70, 300, 5], [70, 1, 5], 4, 16,
                                                    torch.float32)  # fmt: skip
    fp8 = cache.to(torch.float8_e4m3fn)
    rounded = [latent.to(torch.float8_e4m3fn).double() for latent in latents]
    out = torch.empty(query.shape[0], 4, RANK)
    args = (torch.from_numpy(tables), torch.from_numpy(lens), torch.from_numpy(qsl), 0.1, RANK)
    ops.mla_attention(out, query, fp8.view(torch.uint8), *args)
    want = reference(query, rounded, lens, qsl, 0.1)
    assert ((out.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    # (and not the unrounded latents': the rounding is e4m3's)
    assert (out.double() - reference(query, latents, lens, qsl, 0.1)).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"float32 over an fp8 cache"):
        ops.mla_attention(out.bfloat16(), query.bfloat16(), fp8.view(torch.uint8), *args)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and built_with_cuda()),
    reason="needs a CUDA GPU and pyengine built with CUDA",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("seq_lens", "q_lens"),
    [([1, 17, 40, 300], [1, 1, 1, 1]), ([50, 120, 9], [7, 30, 9]), ([3000, 20], [1, 2])],
    ids=["decode", "chunked", "split"],
)  # fmt: skip
def test_the_cuda_kernel_matches_the_float64_reference(
    dtype: torch.dtype, seq_lens: list[int], q_lens: list[int]
) -> None:
    """cuda/mla_attention.cu (its host run: cpp/tests/test_cuda_mla.cpp) on the GPU, with a
    latent of 64 + 32 and 8 heads, over shuffled blocks, a poisoned output."""
    rng = np.random.default_rng()
    cache, tables, lens, qsl, query, latents = make(rng, seq_lens, q_lens, 8, 16, dtype)
    scale = 0.3 / math.sqrt(RANK + ROPE)
    out = torch.full((query.shape[0], 8, RANK), float("nan"), dtype=dtype, device="cuda")
    device_args = [torch.from_numpy(a).cuda() for a in (tables, lens, qsl)]
    ops.mla_attention(out, query.cuda(), cache.cuda(), *device_args, scale, RANK)
    want = reference(query, latents, lens, qsl, scale)
    error = ((out.cpu().double() - want).abs().max() / want.abs().max()).item()
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), error
