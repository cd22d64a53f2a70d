"""A request's priority (scheduling_policy "priority": lower first, vLLM's) and its
cache_salt (prefix-cache blocks shared only among requests of one salt), offline on the
default model: the finishing order of requests that wait for the one running row, the
cached tokens of one prompt under salts, and the errors for what the engine refuses."""

from __future__ import annotations

import pytest
from helpers.smollm2 import default_llm

from pyengine import LLM, SamplingParams

# A prompt of several blocks (16 tokens each), so that a hit caches whole blocks.
PROMPT = "Tenants share one engine but never one another's cache. " * 6


def finishing_order(llm: LLM, priority: list[int] | None) -> list[int]:
    prompts = [f"Count to {i}:" for i in range(len(priority or [0] * 4))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, priority=priority)
    return sorted(range(len(outs)), key=lambda i: outs[i].metrics.finished_time or 0.0)


def test_priority_orders_the_waiting_requests() -> None:
    """One row at a time: under "priority" the lowest value runs first, ties in arrival
    order; under "fcfs" arrival order alone, and a priority is refused."""
    urgent_first = default_llm(max_model_len=256, max_num_seqs=1, scheduling_policy="priority")
    assert finishing_order(urgent_first, [5, 5, 0, 3]) == [2, 3, 0, 1]
    arrival = default_llm(max_model_len=256, max_num_seqs=1)
    assert finishing_order(arrival, None) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="priority 1 needs scheduling_policy 'priority'"):
        arrival.generate(["x"], SamplingParams(max_tokens=1), use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        arrival.generate(["x"], SamplingParams(max_tokens=1), use_tqdm=False, priority=[0, 0])
    with pytest.raises(ValueError, match="scheduling_policy"):
        default_llm(max_model_len=256, scheduling_policy="lifo")


def test_a_salt_keeps_a_prompts_blocks_to_its_own_requests() -> None:
    llm = default_llm(max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=2)

    def cached(salt: str | None) -> int:
        prompt = {"prompt": PROMPT} if salt is None else {"prompt": PROMPT, "cache_salt": salt}
        return llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0  # the same salt shares its blocks
    assert cached("tenant-b") == 0  # another salt never does
    assert cached(None) == 0  # nor does no salt
    assert cached(None) > 0
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate({"prompt": PROMPT, "cache_salt": ""}, params, use_tqdm=False)
    kv = llm.llm_engine.scheduler.kv_cache
    assert llm.llm_engine.executor.num_blocks - kv.num_free_blocks == 0  # nothing held after
