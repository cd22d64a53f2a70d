"""The CUDA kernels (cuda/) against float64 torch references on fresh random inputs, with
poisoned outputs and shuffled cache slots. Skipped, with the reason shown, where there is
no GPU or pyengine was built without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.attention import (
    check_output,
    fill_caches,
    make_case,
    release_unread_blocks,
    to_dtype,
)
from helpers.layer_ops import (
    DTYPES,
    TOLERANCE,
    rel_error,
    rms_norm_reference,
    rotary_reference,
)

from pyengine import built_with_cuda, ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and built_with_cuda()),
        reason="needs a CUDA GPU and pyengine built with CUDA"
        if built_with_cuda()
        else "pyengine was built without CUDA (no nvcc, or PYENGINE_CUDA=off)",
    ),
]

CUDA = "cuda"


def poisoned_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 4096, 5120])
def test_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    x = torch.randn(37, hidden, device=CUDA).to(dtype)
    weight = (torch.rand(hidden, device=CUDA) + 0.5).to(dtype)
    out = poisoned_like(x)
    ops.rms_norm(out, x, weight, 1e-6)
    assert rel_error(out, rms_norm_reference(x, weight, 1e-6)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype: torch.dtype) -> None:
    x, residual = torch.randn(2, 300, 2048, device=CUDA).to(dtype)
    weight = (torch.rand(2048, device=CUDA) + 0.5).to(dtype)
    stream = residual.double() + x.double()
    want = rms_norm_reference(stream, weight, 1e-5)
    ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert rel_error(residual, stream) < TOLERANCE[dtype]
    assert rel_error(x, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("position_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_rotary_embedding(
    dtype: torch.dtype, head_size: int, position_dtype: torch.dtype, is_neox: bool
) -> None:
    tokens, heads, kv_heads, max_positions = 45, 8, 2, 4096
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_size, 2).double() / head_size))
    freqs = torch.arange(max_positions).double()[:, None] * inv_freq
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).float().to(CUDA)
    positions = torch.randint(0, max_positions, (tokens,), device=CUDA)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, device=CUDA).to(dtype)
    q = qkv[:, : heads * head_size].view(tokens, heads, head_size)
    k = qkv[:, heads * head_size : (heads + kv_heads) * head_size].view(tokens, kv_heads, head_size)
    v_before = qkv[:, (heads + kv_heads) * head_size :].clone()
    q0, k0 = q.double().clone(), k.double().clone()
    ops.rotary_embedding(positions.to(position_dtype), q, k, cache, is_neox)
    assert rel_error(q, rotary_reference(q0, freqs, positions, is_neox)) < TOLERANCE[dtype]
    assert rel_error(k, rotary_reference(k0, freqs, positions, is_neox)) < TOLERANCE[dtype]
    assert torch.equal(qkv[:, (heads + kv_heads) * head_size :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = (torch.randn(333, 2 * 1376, device=CUDA) * 4).to(dtype)
    out = torch.full((333, 1376), float("nan"), device=CUDA, dtype=dtype)
    ops.silu_and_mul(out, x)
    xd = x.double()
    want = torch.nn.functional.silu(xd[:, :1376]) * xd[:, 1376:]
    assert rel_error(out, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kv_heads", "head_size", "block_size"), [(8, 128, 16), (2, 64, 32)])
def test_reshape_and_cache(
    dtype: torch.dtype, kv_heads: int, head_size: int, block_size: int
) -> None:
    num_blocks, tokens = 40, 150
    key = torch.randn(tokens, kv_heads, head_size, device=CUDA).to(dtype)
    value = torch.randn(tokens, kv_heads, head_size, device=CUDA).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:tokens].to(CUDA)
    slots[7] = -1  # padding: skipped
    key_cache = torch.full((num_blocks, kv_heads, head_size, block_size), float("nan"))
    value_cache = torch.full((num_blocks, kv_heads, block_size, head_size), float("nan"))
    key_cache, value_cache = key_cache.to(CUDA, dtype), value_cache.to(CUDA, dtype)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    torch.cuda.synchronize()
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        written[block, offset] = True
        assert torch.equal(key_cache[block, :, :, offset], key[t])
        assert torch.equal(value_cache[block, :, offset, :], value[t])
    # Every other slot kept its poison.
    assert key_cache.permute(0, 3, 1, 2)[~written.to(CUDA)].isnan().all()
    assert value_cache.permute(0, 2, 1, 3)[~written.to(CUDA)].isnan().all()


# Rows the kernels' 16-byte packs do not fit, each for one reason: rows a stride of
# width + 1 apart from an aligned start; rows a whole number of packs apart from a start
# one element in; or contiguous rows of a width that is not a whole number of packs
# (the width given is then made odd: 1000 -> 1004 = 125.5 packs of 8).
LAYOUTS = ["odd-stride", "offset-start", "odd-width"]


def unaligned(
    rows: int, width: int, dtype: torch.dtype, layout: str, scale: float = 1.0
) -> torch.Tensor:
    """[rows, width] (width + 4 for odd-width) laid out as `layout` says."""
    if layout == "odd-width":
        return (torch.randn(rows, width + 4, device=CUDA) * scale).to(dtype)
    extra, start = (1, 0) if layout == "odd-stride" else (16, 1)
    whole = (torch.randn(rows, width + extra, device=CUDA) * scale).to(dtype)
    return whole[:, start : start + width]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layers_on_unaligned_rows(dtype: torch.dtype, layout: str) -> None:
    """The fused layers where 16-byte packs do not fit: the same results, and nothing
    of the tensors the views are cut from written outside them."""
    x = unaligned(37, 1000, dtype, layout)
    width = x.shape[1]
    weight = (torch.rand(width, device=CUDA) + 0.5).to(dtype)
    out = poisoned_like(x)
    ops.rms_norm(out, x, weight, 1e-6)
    assert rel_error(out, rms_norm_reference(x, weight, 1e-6)) < TOLERANCE[dtype]

    residual = unaligned(37, 1000, dtype, layout)
    bases = [t if t._base is None else t._base for t in (x, residual)]
    before = [base.clone() for base in bases]
    stream = residual.double() + x.double()
    ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert rel_error(residual, stream) < TOLERANCE[dtype]
    assert rel_error(x, rms_norm_reference(stream, weight, 1e-5)) < TOLERANCE[dtype]
    for view, base, old in zip((x, residual), bases, before, strict=True):
        first = view.storage_offset() - base.storage_offset()  # a column of row 0
        outside = torch.ones_like(base, dtype=torch.bool)
        outside[:, first : first + view.shape[1]] = False
        assert torch.equal(base[outside], old[outside])

    gate_up = unaligned(29, 2 * 500, dtype, layout, scale=4.0)
    n = gate_up.shape[1] // 2
    out = torch.full((29, n), float("nan"), device=CUDA, dtype=dtype)
    ops.silu_and_mul(out, gate_up)
    xd = gate_up.double()
    assert rel_error(out, torch.nn.functional.silu(xd[:, :n]) * xd[:, n:]) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotary_embedding_and_cache_writes_on_unaligned_rows(
    dtype: torch.dtype, is_neox: bool, layout: str
) -> None:
    tokens, heads, kv_heads, d, max_positions = 21, 4, 2, 64, 512
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).double() / d))
    freqs = torch.arange(max_positions).double()[:, None] * inv_freq
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).float().to(CUDA)
    positions = torch.randint(0, max_positions, (tokens,), device=CUDA)
    qkv = unaligned(tokens, (heads + 2 * kv_heads) * d, dtype, layout)[
        :, : (heads + 2 * kv_heads) * d
    ]
    q = qkv[:, : heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d)
    q0, k0 = q.double().clone(), k.double().clone()
    ops.rotary_embedding(positions, q, k, cache, is_neox)
    assert rel_error(q, rotary_reference(q0, freqs, positions, is_neox)) < TOLERANCE[dtype]
    assert rel_error(k, rotary_reference(k0, freqs, positions, is_neox)) < TOLERANCE[dtype]

    block_size = 16
    slots = torch.randperm(4 * block_size, device=CUDA)[:tokens]
    key_cache = torch.zeros(4, kv_heads, d, block_size, device=CUDA, dtype=dtype)
    value_cache = torch.zeros(4, kv_heads, block_size, d, device=CUDA, dtype=dtype)
    ops.reshape_and_cache(k, v, key_cache, value_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.equal(key_cache[block, :, :, offset], k[t])
        assert torch.equal(value_cache[block, :, offset, :], v[t])


def test_runs_on_the_current_stream() -> None:
    x = torch.randn(64, 1024, device=CUDA)
    weight = torch.ones(1024, device=CUDA)
    out = torch.full_like(x, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # holds the side stream back for a while
        ops.rms_norm(out, x, weight, 1e-6)
    torch.cuda.current_stream().synchronize()
    assert out.isnan().all(), "the kernel ran on another stream than the current one"
    stream.synchronize()
    want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert rel_error(out, want) < 1e-5


def test_tensors_on_two_devices_are_a_clear_error() -> None:
    x = torch.randn(4, 64, device=CUDA)
    with pytest.raises(ValueError, match="rms_norm: weight is on cpu; the op's tensors must all"):
        ops.rms_norm(torch.empty_like(x), x, torch.ones(64), 1e-6)
    key_cache = torch.zeros(4, 1, 64, 16, device=CUDA)
    value_cache = torch.zeros(4, 1, 16, 64, device=CUDA)
    with pytest.raises(ValueError, match="slot_mapping is on cpu"):
        ops.reshape_and_cache(
            torch.randn(2, 1, 64, device=CUDA),
            torch.randn(2, 1, 64, device=CUDA),
            key_cache,
            value_cache,
            torch.tensor([0, 1]),
        )


def run_attention_case(
    seq_lens: list[int],
    q_lens: list[int],
    heads: tuple[int, int],
    head_size: int,
    block_size: int,
    dtype: str,
    window: int = 0,
    soft_cap: float = 0.0,
    max_query_len: int = 0,
    sinks: np.ndarray | None = None,
    chunk: int = 0,
    released: bool = False,
) -> None:
    """The CUDA kernel on test_attention's cases (shuffled block tables, NaN in every
    slot no request uses, a poisoned output) against its float64 reference; `sinks`:
    each head's sink logit (float32); `chunk`: chunked local attention's; `released`:
    the blocks no query sees released (-1 in the tables, NaN in the caches)."""
    case = make_case(np.random.default_rng(), seq_lens, q_lens, *heads, head_size, block_size)
    key_cache, value_cache = fill_caches(case, block_size, dtype)
    tables = case.block_tables
    if released:
        tables = release_unread_blocks(case, (key_cache, value_cache), block_size, window, chunk)

    def on_gpu(x: object) -> torch.Tensor:
        t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))
        return t.to(CUDA)

    query = to_dtype(case.query, dtype)
    out = torch.full(case.query.shape, float("nan"), device=CUDA, dtype=on_gpu(query).dtype)
    scale = head_size**-0.5
    ops.paged_attention(
        out,
        on_gpu(query),
        on_gpu(key_cache),
        on_gpu(value_cache),
        on_gpu(tables),
        on_gpu(case.seq_lens),
        on_gpu(case.query_start_loc),
        scale,
        window,
        soft_cap,
        0,
        max_query_len,
        None if sinks is None else on_gpu(sinks.astype(np.float32)),
        chunk,
    )
    got = out.double().cpu().numpy()
    wide = None if sinks is None else sinks.astype(np.float32).astype(np.float64)
    tolerance = TOLERANCE[getattr(torch, dtype)]
    check_output(case, got, dtype, scale, window, soft_cap, tolerance, sinks=wide, chunk=chunk)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(
    ("seq_lens", "q_lens"),
    [
        ([1, 17, 40, 300], [1, 1, 1, 1]),  # decode
        ([5, 33, 64], [5, 33, 64]),  # prefill
        ([50, 120, 9], [7, 30, 0]),  # chunked prefill on a cached prefix; a forked sample
        ([3000, 700, 1], [1, 1, 1]),  # long contexts: split into partitions and merged
        ([1100, 90], [1100, 90]),  # enough (token, head) pairs to run unsplit
    ],
    ids=["decode", "prefill", "chunked", "split", "unsplit"],
)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_paged_attention(
    dtype: str, seq_lens: list[int], q_lens: list[int], heads: tuple[int, int]
) -> None:
    run_attention_case(seq_lens, q_lens, heads, 128, 16, dtype)


@pytest.mark.parametrize("head_size", [32, 64, 80, 96, 112, 128, 192, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_paged_attention_head_and_block_sizes(head_size: int, block_size: int) -> None:
    # float16/bfloat16 with head sizes 64, 80, 96, 128, 256 run on tensor cores: 8-warp
    # tiles where a request has several query tokens, 1-warp tiles for decode alone
    run_attention_case([70, 1000], [70, 1], (4, 2), head_size, block_size, "bfloat16")
    run_attention_case([33, 1000, 5], [1, 1, 1], (4, 2), head_size, block_size, "bfloat16")


@pytest.mark.parametrize(
    "heads", [(8, 1), (12, 4), (64, 1), (80, 1), (16, 16)], ids=["g8", "g3", "g64", "g80", "g1"]
)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_paged_attention_group_sizes(heads: tuple[int, int], dtype: str) -> None:
    """GQA groups that fill a tensor-core tile's rows (128, or 64 in four-warp blocks)
    unevenly, exactly, or not at all (80 query heads per kv head: the scalar kernel)."""
    run_attention_case([130, 700, 33], [130, 1, 20], heads, 64, 16, dtype)


def test_four_warp_prefill_blocks_in_a_fresh_process() -> None:
    """PYENGINE_FLASH_PREFILL_WARPS=4 (read once a process) runs prefills in four-warp
    blocks, which pass the same cases; any value but 4 or 8 is a clear error."""
    code = (
        "import test_cuda_kernels as t\n"
        "for h in (64, 80, 96, 128, 256):\n"
        "    t.run_attention_case([70, 1000, 9], [70, 30, 1], (8, 2), h, 16, 'bfloat16')\n"
        "t.run_attention_case([130, 700], [130, 20], (64, 1), 64, 16, 'float16')\n"
    )

    def run(value: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYENGINE_FLASH_PREFILL_WARPS": value}
        return subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip

    four = run("4")
    assert four.returncode == 0, four.stderr[-2000:]
    bad = run("6")
    assert bad.returncode != 0
    assert "PYENGINE_FLASH_PREFILL_WARPS must be 4 or 8, not '6'" in bad.stderr


@pytest.mark.parametrize("max_query_len", [0, 1, 7, 300, 10_000])
def test_paged_attention_max_query_len_hint(max_query_len: int) -> None:
    """The hint sizes the grid; one too small (1, 7) leaves blocks several tiles each."""
    run_attention_case(
        [300, 40, 900], [300, 1, 90], (8, 2), 128, 16, "bfloat16", max_query_len=max_query_len
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("window", "soft_cap"), [(32, 0.0), (0, 30.0), (100, 50.0)])
@pytest.mark.parametrize(
    ("seq_lens", "q_lens"), [([300, 1200], [300, 1]), ([1200, 700], [1200, 700])],
    ids=["split", "unsplit"],
)  # fmt: skip
def test_paged_attention_sliding_window_and_soft_cap(
    window: int, soft_cap: float, seq_lens: list[int], q_lens: list[int], dtype: str
) -> None:
    run_attention_case(seq_lens, q_lens, (8, 2), 128, 16, dtype, window, soft_cap)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("seq_lens", "q_lens"), [([300, 1200], [300, 1]), ([1200, 700], [1200, 700])],
    ids=["split", "unsplit"],
)  # fmt: skip
def test_paged_attention_sinks(seq_lens: list[int], q_lens: list[int], dtype: str) -> None:
    """gpt-oss's per-head sinks, with and without its 128-token window."""
    sinks = np.random.default_rng().normal(0.0, 2.0, 8)
    for window in (0, 128):
        run_attention_case(seq_lens, q_lens, (8, 2), 64, 16, dtype, window, sinks=sinks)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("seq_lens", "q_lens"), [([300, 1200], [300, 1]), ([1200, 700], [1200, 700])],
    ids=["split", "unsplit"],
)  # fmt: skip
def test_paged_attention_chunks_and_released_blocks(
    seq_lens: list[int], q_lens: list[int], dtype: str
) -> None:
    """Llama 4's chunked local attention, and a window's released blocks (-1, NaN) that no
    kernel reads."""
    for window, chunk in ((0, 256), (128, 0), (100, 512)):
        run_attention_case(seq_lens, q_lens, (8, 2), 128, 16, dtype, window, chunk=chunk,
                           released=True)  # fmt: skip


def test_reshape_and_cache_strided_heads() -> None:
    """Key and value as views with heads apart ([tokens, kv_heads, 2, d][:, :, i])."""
    tokens, kv_heads, d, block_size = 20, 4, 64, 16
    kv = torch.randn(tokens, kv_heads, 2, d, device=CUDA)
    key, value = kv[:, :, 0], kv[:, :, 1]
    slots = torch.randperm(4 * block_size, device=CUDA)[:tokens]
    key_cache = torch.zeros(4, kv_heads, d, block_size, device=CUDA)
    value_cache = torch.zeros(4, kv_heads, block_size, d, device=CUDA)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.equal(key_cache[block, :, :, offset], key[t])
        assert torch.equal(value_cache[block, :, offset, :], value[t])


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_to_pinned_host_memory_and_back(dtype: torch.dtype) -> None:
    cache = torch.randn(12, 2, 16, 64, device=CUDA).to(dtype)
    pool = torch.full((6, 2, 16, 64), float("nan"), dtype=dtype).pin_memory()
    out_pairs = torch.tensor([[5, 0], [2, 3], [11, 5]])
    ops.swap_blocks(cache, pool, out_pairs)  # out to the host pool
    torch.cuda.current_stream().synchronize()
    for s, d in out_pairs.tolist():
        assert torch.equal(pool[d], cache[s].cpu())
    assert pool[[1, 2, 4]].isnan().all()
    back = cache.clone()
    ops.swap_blocks(pool, back, torch.tensor([[0, 7], [5, 1]]))  # and back
    torch.cuda.synchronize()
    assert torch.equal(back[7], cache[5]) and torch.equal(back[1], cache[11])
    untouched = [b for b in range(12) if b not in (1, 7)]
    assert torch.equal(back[untouched], cache[untouched])


@pytest.mark.parametrize(("num_tokens", "block_size"), [(100_003, 16), (4096, 64), (33, 1)])
def test_block_content_hashes_on_the_gpu_equal_the_cpu(num_tokens: int, block_size: int) -> None:
    from pyengine import _C

    tokens = torch.randint(0, 150_000, (num_tokens,), dtype=torch.int32)
    on_cpu = torch.zeros(num_tokens // block_size, dtype=torch.int64)
    _C.block_content_hashes(tokens, block_size, on_cpu)
    on_gpu = torch.zeros_like(on_cpu, device=CUDA)
    stream = torch.cuda.current_stream().cuda_stream
    _C.block_content_hashes(tokens.to(CUDA), block_size, on_gpu, stream)
    assert torch.equal(on_gpu.cpu(), on_cpu)
