"""fp8 (e4m3) KV caches on the CPU, stored as uint8: reshape_and_cache writes torch's e4m3
rounding of each value (ties to even, saturated at 448, NaN kept), and paged_attention
over them is bit for bit paged_attention over a float32 cache of the widened values, in
every build of the kernel; against float64 too. The engine runs with kv_cache_dtype="fp8"
(and "int8") close to the float32 cache; the other devices and dtypes refuse them."""

from __future__ import annotations

import pytest
import torch
from helpers.attention import causal_attention, check_float32_inputs_only
from helpers.tiny_models import make_checkpoint

from pyengine import _C, LLM, SamplingParams, ops
from pyengine.config import INT8_SCALE_BYTES
from pyengine.engine.engine_args import resolve_kv_cache_dtype

ISAS = [isa for isa in ("generic", "avx2", "avx512") if _C.cpu_supports(isa)]
KV_HEADS, HEADS, HEAD_SIZE, BLOCK, BLOCKS = 2, 8, 64, 16, 48


def caches(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    key = torch.zeros(BLOCKS, KV_HEADS, HEAD_SIZE, BLOCK, dtype=dtype)
    value = torch.zeros(BLOCKS, KV_HEADS, BLOCK, HEAD_SIZE, dtype=dtype)
    return key, value


def test_reshape_and_cache_writes_torchs_e4m3() -> None:
    tokens = 37
    key = torch.randn(tokens, KV_HEADS, HEAD_SIZE) * torch.logspace(-4, 3, HEAD_SIZE)
    value = torch.randn(tokens, KV_HEADS, HEAD_SIZE) * 2
    key[0, 0, :4] = torch.tensor([500.0, -1e6, 448.0, float("nan")])
    slots = torch.randperm(BLOCKS * BLOCK)[:tokens]
    k8, v8 = caches(torch.uint8)
    ops.reshape_and_cache(key, value, k8, v8, slots)
    blocks, offsets = slots // BLOCK, slots % BLOCK
    got_k = k8.view(torch.float8_e4m3fn)[blocks, :, :, offsets].float()  # [tokens, heads, d]
    got_v = v8.view(torch.float8_e4m3fn)[blocks, :, offsets, :].float()
    want_k = key.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert torch.equal(got_k.nan_to_num(), want_k.nan_to_num())
    assert torch.isnan(got_k[0, 0, 3]) and got_k[0, 0, 0] == 448 and got_k[0, 0, 1] == -448
    assert torch.equal(got_v, value.to(torch.float8_e4m3fn).float())


def test_static_scales_divide_what_an_fp8_cache_stores() -> None:
    """A checkpoint's k_scale/v_scale: e4m3(x / scale), rounded once as torch rounds."""
    tokens = 21
    key, value = torch.randn(tokens, KV_HEADS, HEAD_SIZE), torch.randn(tokens, KV_HEADS, HEAD_SIZE)
    slots = torch.randperm(BLOCKS * BLOCK)[:tokens]
    k8, v8 = caches(torch.uint8)
    ops.reshape_and_cache(key, value, k8, v8, slots, 0.01, 0.3)
    blocks, offsets = slots // BLOCK, slots % BLOCK
    got_k = k8.view(torch.float8_e4m3fn)[blocks, :, :, offsets].float()
    got_v = v8.view(torch.float8_e4m3fn)[blocks, :, offsets, :].float()
    assert torch.equal(got_k, (key / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert torch.equal(got_v, (value / 0.3).to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("context", "queries"), [(1, 1), (100, 1), (333, 1), (77, 77), (200, 30)])
def test_attention_over_fp8_is_attention_over_its_values(
    isa: str, context: int, queries: int
) -> None:
    key, value = (
        torch.randn(context, KV_HEADS, HEAD_SIZE),
        torch.randn(context, KV_HEADS, HEAD_SIZE),
    )
    table = torch.randperm(BLOCKS)[: -(-context // BLOCK)].to(torch.int32)
    slots = table.long()[torch.arange(context) // BLOCK] * BLOCK + torch.arange(context) % BLOCK
    k8, v8 = caches(torch.uint8)
    kf, vf = caches(torch.float32)
    ops.reshape_and_cache(key, value, k8, v8, slots)
    widened = (key.to(torch.float8_e4m3fn).float(), value.to(torch.float8_e4m3fn).float())
    ops.reshape_and_cache(*widened, kf, vf, slots)
    query = torch.randn(queries, HEADS, HEAD_SIZE)
    args = (table[None], torch.tensor([context], dtype=torch.int32),
            torch.tensor([0, queries], dtype=torch.int32), HEAD_SIZE**-0.5)  # fmt: skip
    _C.set_attention_isa(isa)
    try:
        out8, outf = torch.empty_like(query), torch.empty_like(query)
        ops.paged_attention(out8, query, k8, v8, *args)
        ops.paged_attention(outf, query, kf, vf, *args)
    finally:
        _C.set_attention_isa("auto")
    assert torch.equal(out8, outf)
    torch.testing.assert_close(out8.double(), causal_attention(query, *widened),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_fp8_caches_take_float32_queries_only() -> None:
    check_float32_inputs_only(*caches(torch.uint8), HEADS, HEAD_SIZE)


@pytest.mark.parametrize(
    ("kv", "storage", "padding", "tolerance"),
    # e4m3: 3 mantissa bits; int8: a scale per token and head, 4 bytes beside its values
    [("fp8", torch.uint8, 0, 0.1), ("int8", torch.int8, INT8_SCALE_BYTES, 0.05)],
)
def test_the_engine_runs_a_narrow_cache_where_weights_are_float32(  # type: ignore[no-untyped-def]
    tmp_path, kv: str, storage: torch.dtype, padding: int, tolerance: float
) -> None:
    make_checkpoint("llama", tmp_path)
    prompts = [{"prompt_token_ids": list(range(10, 70))}, {"prompt_token_ids": [3, 4, 5]}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    runs = {}
    for cache in ("auto", kv):
        llm = LLM(
            str(tmp_path),
            kv_cache_dtype=cache,
            max_model_len=128,
            kv_cache_memory=2**22,
            dtype="float32",
        )
        runs[cache] = llm.generate(prompts, params, use_tqdm=False)
        runner = llm.llm_engine.executor.driver_worker.model_runner
        assert runner.cache_dtype == (storage if cache == kv else torch.float32)
        key_cache, value_cache = runner.caches[0]
        head = runner.model.config.head_size + (padding if cache == kv else 0)
        assert key_cache.shape[2] == value_cache.shape[3] == head
        llm.llm_engine.shutdown()
    for narrow, full in zip(runs[kv], runs["auto"], strict=True):
        first = narrow.outputs[0].logprobs[0]
        for token, entry in full.outputs[0].logprobs[0].items():
            assert abs(first[token].logprob - entry.logprob) < tolerance


def test_narrow_caches_need_float32_weights_on_the_cpu_and_16_bit_ones_on_cuda() -> None:
    assert resolve_kv_cache_dtype("fp8_e4m3", "float32", "cpu") == "fp8_e4m3"
    assert resolve_kv_cache_dtype("int8", "float32", "cpu") == "int8"
    for device in ("cuda", "cuda:1"):
        assert resolve_kv_cache_dtype("fp8", "bfloat16", device) == "fp8_e4m3"
        assert resolve_kv_cache_dtype("int8", "float16", device) == "int8"
    for kv, dtype, device in (("fp8", "bfloat16", "cpu"), ("int8", "bfloat16", "cpu"),
                              ("fp8", "float32", "cuda"), ("int8", "float32", "cuda:0"),
                              ("float16", "bfloat16", "cuda")):  # fmt: skip
        with pytest.raises(ValueError, match="needs float32 weights on the CPU, or on CUDA"):
            resolve_kv_cache_dtype(kv, dtype, device)
