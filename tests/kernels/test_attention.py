"""CPU paged attention and reshape_and_cache against a float64 reference.

Fresh random inputs each run, shuffled block tables whose unused entries are garbage,
outputs poisoned with NaN before every call (an unwritten element fails).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from helpers.attention import (
    Case,
    check_output,
    fill_caches,
    make_case,
    release_unread_blocks,
    to_dtype,
    to_float64,
)

from pyengine import _C, paged_attention, reshape_and_cache

HEAD_SIZES = [32, 64, 80, 96, 112, 128, 192, 256]
ISAS = [isa for isa in ("generic", "avx2", "avx512") if _C.cpu_supports(isa)]


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each build of the kernel this CPU can run."""
    _C.set_attention_isa(request.param)
    yield request.param
    _C.set_attention_isa("auto")


TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}


def run_case(
    case: Case,
    block_size: int,
    dtype: str,
    window: int = 0,
    soft_cap: float = 0.0,
    cache_dtype: str | None = None,
    tolerance: float | None = None,
    sinks: np.ndarray | None = None,
    chunk: int = 0,
    released: bool = False,
) -> None:
    """query and out in `dtype`, the caches in `cache_dtype` (default: the same);
    `tolerance` relative to the output's largest value (default: the dtype's); `sinks`:
    each head's sink logit; `chunk`: chunked local attention's; `released`: the blocks
    no query sees released from the tables (-1) and NaN in the caches."""
    cache_dtype = cache_dtype or dtype
    key_cache, value_cache = fill_caches(case, block_size, cache_dtype)
    tables = case.block_tables
    if released:
        tables = release_unread_blocks(case, (key_cache, value_cache), block_size, window, chunk)
    query = to_dtype(case.query, dtype)
    out = to_dtype(np.full(case.query.shape, np.nan), dtype)
    scale = 1.0 / math.sqrt(case.query.shape[2])
    paged_attention(
        out,
        query,
        key_cache,
        value_cache,
        tables,
        case.seq_lens,
        case.query_start_loc,
        scale,
        window,
        soft_cap,
        sinks=None if sinks is None else torch.from_numpy(sinks.astype(np.float32)),
        attention_chunk=chunk,
    )
    tolerance = tolerance or TOLERANCE[dtype]
    wide = None if sinks is None else sinks.astype(np.float32).astype(np.float64)
    check_output(
        case, to_float64(out), dtype, scale, window, soft_cap, tolerance, cache_dtype, wide, chunk
    )


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(
    ("seq_lens", "q_lens"),
    [
        ([1, 17, 40, 300], [1, 1, 1, 1]),  # decode
        ([5, 33, 64], [5, 33, 64]),  # prefill
        ([50, 120, 9], [7, 30, 9]),  # chunked prefill on a cached prefix, and a prefill
    ],
    ids=["decode", "prefill", "chunked"],
)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"),
    [(4, 4), (8, 2), (9, 3), (4, 1)],
    ids=["mha", "gqa", "gqa3", "mqa"],  # (gqa3: SmolLM2's groups, 3-row decode tiles)
)
def test_matches_the_reference(
    isa: str,
    dtype: str,
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
) -> None:
    rng = np.random.default_rng()
    case = make_case(rng, seq_lens, q_lens, num_heads, num_kv_heads, 64, 16)
    run_case(case, 16, dtype)


@pytest.mark.parametrize("cache_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    ("seq_lens", "q_lens"),
    [([1, 17, 40, 300], [1, 1, 1, 1]), ([5, 33, 64], [5, 33, 64]), ([50, 120, 9], [7, 30, 9])],
    ids=["decode", "prefill", "chunked"],
)
def test_float32_queries_over_a_16_bit_cache(
    isa: str, cache_dtype: str, seq_lens: list[int], q_lens: list[int]
) -> None:
    """kv_cache_dtype on the CPU: float32 queries and output over a float16/bfloat16
    cache, exact to float32 arithmetic on the cache's rounded K/V."""
    rng = np.random.default_rng()
    case = make_case(rng, seq_lens, q_lens, 8, 2, 64, 16)
    run_case(case, 16, "float32", cache_dtype=cache_dtype)
    run_case(case, 16, "float32", window=20, soft_cap=5.0, cache_dtype=cache_dtype)


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_every_head_size_and_block_size(isa: str, head_size: int, block_size: int) -> None:
    rng = np.random.default_rng()
    case = make_case(rng, [70, 3], [20, 1], 4, 2, head_size, block_size)
    run_case(case, block_size, "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_sinks(isa: str, dtype: str) -> None:
    """gpt-oss's: each head's sink logit takes a share of the softmax; with a window, in
    prefill and decode, and over a context long enough to be split across threads."""
    rng = np.random.default_rng()
    case = make_case(rng, [90, 2500, 7], [1, 40, 7], 8, 2, 64, 16)
    sinks = rng.normal(0.0, 2.0, 8)
    run_case(case, 16, dtype, sinks=sinks)
    run_case(case, 16, dtype, window=32, sinks=sinks)
    decode = make_case(rng, [4000], [1], 8, 1, 64, 16)  # (one tile, split over threads)
    run_case(decode, 16, dtype, sinks=sinks)
    with pytest.raises(ValueError, match=r"sinks must be dense float32 \[8\] \(num_heads\)"):
        run_case(decode, 16, dtype, sinks=sinks[:7])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sliding_window_and_soft_cap(isa: str, dtype: str) -> None:
    rng = np.random.default_rng()
    case = make_case(rng, [90, 200, 7], [1, 40, 7], 8, 2, 128, 16)
    run_case(case, 16, dtype, window=32)
    run_case(case, 16, dtype, soft_cap=5.0)
    run_case(case, 16, dtype, window=17, soft_cap=2.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_attention_and_released_blocks(isa: str, dtype: str) -> None:
    """Llama 4's chunked local attention (a query sees its own chunk), alone and with a
    window; and the blocks wholly before a request's first visible position released
    (-1 in its table, NaN in the cache): never read, so the output is the reference's."""
    rng = np.random.default_rng()
    case = make_case(rng, [90, 200, 7, 130], [1, 40, 7, 70], 8, 2, 128, 16)
    run_case(case, 16, dtype, chunk=32)
    run_case(case, 16, dtype, chunk=48, soft_cap=3.0, released=True)
    run_case(case, 16, dtype, window=20, released=True)
    run_case(case, 16, dtype, window=40, chunk=64, released=True)
    long = make_case(rng, [4000], [1], 8, 1, 64, 16)  # (one tile, split over threads)
    run_case(long, 16, dtype, window=700, released=True)
    run_case(long, 16, dtype, chunk=1024, released=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peaked_softmax(isa: str, dtype: str) -> None:
    """Queries 30x larger: score gaps of hundreds, so most weights underflow to zero (the
    exp's cut below -87) and the running max jumps by far more than that between groups
    of blocks (the accumulator's rescaling)."""
    rng = np.random.default_rng()
    case = make_case(rng, [300, 150, 64, 9], [1, 40, 64, 9], 8, 2, 64, 16)
    case.query *= 30.0
    # Keys that grow along the context, so that later groups raise the max.
    for keys in case.keys:
        keys *= np.linspace(0.2, 3.0, keys.shape[0])[:, None, None]
    # Scores of several hundred carry float32 rounding of about 1e-5 of a weight: what a
    # lost underflow or rescale would do is orders larger.
    run_case(case, 16, dtype, tolerance=1e-4 if dtype == "float32" else None)


def test_requests_without_query_tokens_are_skipped(isa: str) -> None:
    # A sample forked this step sits in the batch with no tokens of its own.
    rng = np.random.default_rng()
    run_case(make_case(rng, [40, 24, 9, 30], [1, 0, 9, 0], 4, 2, 64, 16), 16, "float32")


def test_long_contexts() -> None:
    rng = np.random.default_rng()
    case = make_case(rng, [3000, 2500], [1, 24], 4, 1, 128, 16)
    run_case(case, 16, "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("window", [0, 700])
def test_split_context_of_a_few_long_requests(isa: str, dtype: str, window: int) -> None:
    # One or two tiles cannot keep the threads busy: their contexts are split across
    # threads and the partial softmax results merged.
    rng = np.random.default_rng()
    run_case(make_case(rng, [4000], [1], 2, 1, 64, 16), 16, dtype, window=window)
    run_case(make_case(rng, [2100], [3], 4, 1, 128, 32), 32, dtype, window=window)


def assert_cached(
    key: np.ndarray,
    value: np.ndarray,
    slots: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
) -> None:
    """The caches (zeros before) hold exactly each token's K/V in its slot (-1: none)."""
    block_size = value_cache.shape[2]
    expected_k, expected_v = np.zeros_like(key_cache), np.zeros_like(value_cache)
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected_k[slot // block_size, :, :, slot % block_size] = key[t]
            expected_v[slot // block_size, :, slot % block_size] = value[t]
    np.testing.assert_array_equal(key_cache, expected_k)
    np.testing.assert_array_equal(value_cache, expected_v)


def test_reshape_and_cache_writes_each_token_into_its_slot() -> None:
    rng = np.random.default_rng()
    num_blocks, num_kv_heads, block_size, head_size = 6, 2, 4, 32
    key = rng.standard_normal((10, num_kv_heads, head_size)).astype(np.float32)
    value = rng.standard_normal((10, num_kv_heads, head_size)).astype(np.float32)
    slots = rng.permutation(num_blocks * block_size)[:10].astype(np.int64)
    slots[3] = -1  # padding: skipped
    key_shape = (num_blocks, num_kv_heads, head_size, block_size)
    value_shape = (num_blocks, num_kv_heads, block_size, head_size)
    key_cache = np.zeros(key_shape, np.float32)
    value_cache = np.zeros(value_shape, np.float32)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert_cached(key, value, slots, key_cache, value_cache)
    # Strided K/V views (e.g. slices of a fused qkv projection) work too.
    qkv = rng.standard_normal((10, 3 * num_kv_heads, head_size)).astype(np.float32)
    reshape_and_cache(qkv[:, 2:4], qkv[:, 4:6], key_cache, value_cache, slots)
    np.testing.assert_array_equal(key_cache[slots[0] // 4, :, :, slots[0] % 4], qkv[0, 2:4])
    np.testing.assert_array_equal(value_cache[slots[0] // 4, :, slots[0] % 4], qkv[0, 4:6])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_reshape_and_cache_runs_of_consecutive_slots(dtype: type) -> None:
    """A prefill's tokens fill consecutive slots, written a run at a time: runs that
    start mid-block, cross into another block, follow padding, over a strided view."""
    rng = np.random.default_rng()
    num_blocks, num_kv_heads, block_size, head_size = 8, 3, 4, 64
    blocks = rng.permutation(num_blocks)
    slots = np.array(
        [blocks[0] * 4 + 1, blocks[0] * 4 + 2, blocks[0] * 4 + 3,  # mid-block to its end
         blocks[1] * 4, blocks[1] * 4 + 1, -1, blocks[1] * 4 + 2,  # padding inside a run
         blocks[2] * 4, blocks[2] * 4 + 1, blocks[2] * 4 + 2, blocks[2] * 4 + 3,
         blocks[3] * 4 + 3, blocks[3] * 4 + 2],  # descending: no run
        dtype=np.int64,
    )  # fmt: skip
    qkv = rng.standard_normal((len(slots), 3 * num_kv_heads, head_size)).astype(dtype)
    key, value = qkv[:, 3:6], qkv[:, 6:9]
    key_cache = np.zeros((num_blocks, num_kv_heads, head_size, block_size), dtype)
    value_cache = np.zeros((num_blocks, num_kv_heads, block_size, head_size), dtype)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert_cached(key, value, slots, key_cache, value_cache)


@pytest.mark.parametrize("cache_dtype", ["float16", "bfloat16"])
def test_reshape_and_cache_rounds_float32_into_a_16_bit_cache(cache_dtype: str) -> None:
    """Each element as torch rounds float32 to the cache dtype (to nearest, ties to
    even), for runs of slots and scattered ones, from strided views."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    num_blocks, num_kv_heads, block_size, head_size = 6, 2, 4, 32
    qkv = rng.standard_normal((12, 3 * num_kv_heads, head_size)).astype(np.float32)
    qkv[0, 2, :4] = [65504.0, 1e-7, -3e-5, 2.0**-14 * 1.5]  # float16's edges
    key, value = qkv[:, 2:4], qkv[:, 4:6]
    slots = np.concatenate([np.arange(8, 15), rng.permutation(8)[:4], [-1]]).astype(np.int64)
    dtype = getattr(torch, cache_dtype)
    key_cache = torch.zeros((num_blocks, num_kv_heads, head_size, block_size), dtype=dtype)
    value_cache = torch.zeros((num_blocks, num_kv_heads, block_size, head_size), dtype=dtype)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    rounded_key = torch.from_numpy(np.ascontiguousarray(key)).to(dtype).float().numpy()
    rounded_value = torch.from_numpy(np.ascontiguousarray(value)).to(dtype).float().numpy()
    assert_cached(
        rounded_key, rounded_value, slots, key_cache.float().numpy(), value_cache.float().numpy()
    )


def test_only_float32_queries_may_read_a_cache_of_another_dtype() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    case = make_case(rng, [20], [1], 4, 2, 64, 16)
    args = (case.block_tables, case.seq_lens, case.query_start_loc, 0.1)
    f32_caches = fill_caches(case, 16, "float32")
    query = torch.from_numpy(case.query).to(torch.bfloat16)
    with pytest.raises(ValueError, match="query must be float32"):
        paged_attention(torch.zeros_like(query), query, *f32_caches, *args)
    bf16_caches = fill_caches(case, 16, "bfloat16")
    query16 = case.query.astype(np.float16)
    with pytest.raises(ValueError, match="query must be bfloat16"):
        paged_attention(np.zeros_like(query16), query16, *bf16_caches, *args)
    kv = query16[:, :2]
    with pytest.raises(ValueError, match="key must be bfloat16"):
        reshape_and_cache(kv, kv, *bf16_caches, np.zeros(1, np.int64))


def test_isa_names_are_checked() -> None:
    with pytest.raises(ValueError, match="isa must be"):
        _C.set_attention_isa("sse9")
    assert _C.attention_isa() in ISAS


def test_bad_arguments_are_clear_errors() -> None:
    rng = np.random.default_rng()
    case = make_case(rng, [20], [1], 4, 2, 64, 16)
    key_cache, value_cache = fill_caches(case, 16, "float32")
    query = case.query.astype(np.float32)
    out = np.zeros_like(query)
    args = (case.block_tables, case.seq_lens, case.query_start_loc)
    with pytest.raises(ValueError, match="query must be float32"):
        paged_attention(out, query.astype(np.float16), key_cache, value_cache, *args, 0.1)
    with pytest.raises(TypeError, match="unsupported dtype"):
        paged_attention(out, case.query, key_cache, value_cache, *args, 0.1)  # float64
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(out[:, :3], query[:, :3], key_cache, value_cache, *args, 0.1)
    bad_tables = case.block_tables.copy()
    bad_tables[0, 1] = case.num_blocks
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = \d+ is outside"):
        paged_attention(out, query, key_cache, value_cache, bad_tables, *args[1:], 0.1)
    with pytest.raises(ValueError, match="need 0 <= q_len <= seq_len"):
        paged_attention(
            out,
            query,
            key_cache,
            value_cache,
            case.block_tables,
            np.array([0], np.int32),
            case.query_start_loc,
            0.1,
        )
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        paged_attention(
            out,
            query,
            key_cache,
            value_cache,
            case.block_tables,
            case.seq_lens.astype(np.int64),
            case.query_start_loc,
            0.1,
        )
    with pytest.raises(ValueError, match="head_size 48 is not supported"):
        paged_attention(
            out[..., :48],
            query[..., :48],
            np.zeros((4, 2, 48, 16), np.float32),
            np.zeros((4, 2, 16, 48), np.float32),
            *args,
            0.1,
        )
    with pytest.raises(ValueError, match="key_cache .* must be value_cache .* last two dims"):
        paged_attention(out, query, value_cache, value_cache, *args, 0.1)
    no_heads_k, no_heads_v = (
        np.zeros((4, 0, 64, 16), np.float32),
        np.zeros((4, 0, 16, 64), np.float32),
    )
    with pytest.raises(ValueError, match=r"num_kv_heads \(dim 1\) must be at least 1"):
        paged_attention(out, query, no_heads_k, no_heads_v, *args, 0.1)
    with pytest.raises(ValueError, match=r"num_kv_heads \(dim 1\) must be at least 1"):
        reshape_and_cache(query[:, :0], query[:, :0], no_heads_k, no_heads_v, np.zeros(1, np.int64))
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = 999 is outside"):
        reshape_and_cache(
            query[:, :2], query[:, :2], key_cache, value_cache, np.array([999], np.int64)
        )
    with pytest.raises(TypeError, match="supports DLPack"):
        paged_attention(out, query.tolist(), key_cache, value_cache, *args, 0.1)
    with pytest.raises(ValueError, match="logit_soft_cap finite"):
        paged_attention(out, query, key_cache, value_cache, *args, 0.1, logit_soft_cap=math.inf)
    shared_rows = torch.zeros(1, 1, out.shape[2]).expand(out.shape)  # one head's memory
    with pytest.raises(ValueError, match="out is written, but its elements share memory"):
        paged_attention(shared_rows, query, key_cache, value_cache, *args, 0.1)
    assert not out.any()  # nothing was written


def test_no_query_tokens_is_nothing_to_do() -> None:
    """Zero query tokens (no requests, or requests with no new tokens) return at once;
    they divided by the number of tiles, 0, on a machine of several threads (SIGFPE)."""
    key_cache, value_cache = torch.zeros(4, 1, 64, 16), torch.zeros(4, 1, 16, 64)
    empty = torch.empty(0, 1, 64)
    tables, i32 = torch.zeros(2, 1, dtype=torch.int32), torch.int32
    paged_attention(empty, empty, key_cache, value_cache, tables[:0], torch.zeros(0, dtype=i32),
                    torch.zeros(1, dtype=i32), 0.1)  # fmt: skip
    paged_attention(empty, empty, key_cache, value_cache, tables, torch.tensor([3, 5], dtype=i32),
                    torch.zeros(3, dtype=i32), 0.1)  # fmt: skip
