"""The KV cache's host tier on the default model (float32, greedy): prefixes evicted from
a small device pool come back from host memory, or from a file, with exactly the tokens
of an engine without the tier, and swap preemption gives the tokens of recompute. The
tier's own bookkeeping (verified hits across tiers, copy order) is tested in the core's
tests (cpp/tests/test_kv_host_tier.cpp, tests/core)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.smollm2 import default_llm

from pyengine import LLM, SamplingParams
from pyengine.worker.host_kv_tier import HostKVTier
from pyengine.worker.model_runner import kv_block_numel, kv_views

# A device pool of 16 blocks of 4 tokens (one max_model_len request): four of these
# prompts (9 blocks each) do not fit in it together, and three long answers at once must
# be preempted. Steps run eagerly: nothing to record for so few steps.
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
TIER_GB = 0.01  # some 58 blocks
PROMPTS = [f"Document {i}: " + " ".join(f"item{i}{j}" for j in range(8)) for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def small_pool_llm(**engine: object) -> LLM:
    block_bytes = 2 * 30 * 3 * 64 * BLOCK_SIZE * 4  # the default model's, float32
    return default_llm(  # type: ignore[no-any-return]
        kv_cache_memory=MAX_MODEL_LEN // BLOCK_SIZE * block_bytes, max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE, enforce_eager=True, **engine,
    )  # fmt: skip


@pytest.fixture(scope="module")
def no_tier() -> LLM:
    return small_pool_llm()


@pytest.fixture(scope="module")
def tier_swap() -> LLM:
    return small_pool_llm(kv_offload_gb=TIER_GB, preemption_mode="swap")


@pytest.fixture(scope="module")
def baseline(no_tier: LLM) -> tuple[list[list[int]], list[int]]:
    return twice_one_at_a_time(no_tier)


def kv_stats(llm: LLM):  # type: ignore[no-untyped-def]
    return llm.llm_engine.scheduler.kv_cache.stats()


def twice_one_at_a_time(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """Each prompt alone, all of them twice: the second round's prefixes were evicted
    from the device pool by the others'. Their tokens, and their cached prompt tokens,
    every one of which the host tier held (where there is one)."""
    tokens, cached = [], []
    for _ in range(2):
        for prompt in PROMPTS:
            out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
            tokens.append(out.outputs[0].token_ids)
            cached.append(out.num_cached_tokens)
            assert out.num_host_cached_tokens == out.num_cached_tokens
    return tokens, cached


def test_evicted_prefixes_come_back_from_host_memory(
    baseline: tuple[list[list[int]], list[int]], tier_swap: LLM
) -> None:
    expected, cached_without = baseline
    assert cached_without == [0] * 8  # the pool alone keeps none of them
    before = kv_stats(tier_swap)
    tokens, cached = twice_one_at_a_time(tier_swap)
    assert tokens == expected
    assert cached[:4] == [0] * 4
    assert all(c >= 24 for c in cached[4:]), cached  # whole blocks of the prompts
    after = kv_stats(tier_swap)
    assert after.host_cache_hits - before.host_cache_hits == sum(cached[4:])
    assert after.num_blocks_offloaded > before.num_blocks_offloaded
    assert after.num_used_blocks == after.num_host_used_blocks == 0


def test_the_tier_in_a_file_serves_the_same_tokens(
    baseline: tuple[list[list[int]], list[int]], tmp_path: Path
) -> None:
    expected, _ = baseline
    llm = small_pool_llm(kv_offload_gb=TIER_GB, kv_offload_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []  # mapped and unlinked: nothing left behind, ever
    tokens, cached = twice_one_at_a_time(llm)
    assert tokens == expected
    assert all(c >= 24 for c in cached[4:]), cached
    assert kv_stats(llm).host_cache_hits == sum(cached[4:])
    llm.llm_engine.shutdown()


def test_swap_preemption_gives_the_tokens_of_recompute(no_tier: LLM, tier_swap: LLM) -> None:
    """Three long answers at once need more blocks than the pool has: requests are
    preempted, recomputed in one engine and swapped out and back in the other."""
    prompts = [f"Write a long story about the number {i}." for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def run(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    preempted = no_tier.llm_engine.stats().num_preemptions
    recomputed = run(no_tier)
    assert no_tier.llm_engine.stats().num_preemptions > preempted
    swaps = tier_swap.llm_engine.scheduler.stats().num_swapped_preemptions
    swapped = run(tier_swap)
    assert tier_swap.llm_engine.scheduler.stats().num_swapped_preemptions > swaps
    assert swapped == recomputed
    kv = kv_stats(tier_swap)
    assert kv.num_swapped_requests == kv.num_host_used_blocks == kv.num_used_blocks == 0


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"preemption_mode": "swap"}, "preemption_mode 'swap' swaps requests out"),
        ({"preemption_mode": "evict"}, "preemption_mode: invalid value 'evict'"),
        ({"kv_offload_gb": -1.0}, "kv_offload_gb must be a size in GiB"),
        ({"kv_offload_gb": 1e-9}, "holds no KV block"),
        ({"kv_offload_dir": "/tmp"}, "kv_offload_dir holds the host tier: set kv_offload_gb"),
        (
            {"kv_offload_gb": 0.01, "kv_offload_dir": "/no/such/folder"},
            "kv_offload_dir '/no/such/folder' is not a writable folder",
        ),
        (
            {"kv_offload_gb": 0.01, "speculative_config": {"method": "draft_model",
                                                           "num_speculative_tokens": 2,
                                                           "draft_layers": 4}},
            "the host tier does not hold a draft model's KV cache",
        ),
    ],
)  # fmt: skip
def test_a_bad_tier_is_refused_with_its_reason(engine: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        small_pool_llm(**engine)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device"))],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_the_tier_moves_whole_blocks_of_every_layer(device: str, dtype: torch.dtype) -> None:
    """Blocks out to the tier and back into other blocks, checked through the per-layer
    views attention reads (keys transposed), for a second virtual engine's range."""
    layers, heads, head_size, block_size, blocks, engines = 3, 2, 8, 4, 10, 2
    numel = kv_block_numel(layers, heads, head_size, block_size) * blocks
    pool = (torch.randn(numel) * 50).to(dtype).to(device)
    views = kv_views(pool, blocks, layers, heads, head_size, block_size)
    block_bytes = numel // blocks * pool.element_size()
    tier = HostKVTier(6, layers, block_bytes, torch.device(device))
    device_blocks = pool.view(torch.uint8).view(layers, 2, blocks, -1)
    offsets = (blocks // engines, 6 // engines)  # engine 1: blocks 5..9, host blocks 3..5
    before = [(k.clone(), v.clone()) for k, v in views]
    tier.copy_out(device_blocks, [(0, 2), (3, 0)], offsets)
    tier.copy_in(device_blocks, [(2, 1), (0, 4)], offsets)  # into engine 1's 1 and 4
    for (k, v), (k0, v0) in zip(views, before, strict=True):
        for cache, old in ((k, k0), (v, v0)):
            assert torch.equal(cache[6], old[5]) and torch.equal(cache[9], old[8])
            untouched = [b for b in range(blocks) if b not in (6, 9)]
            assert torch.equal(cache[untouched], old[untouched])
