"""pyengine's C++ KV-cache manager and scheduler make the same decisions as the pure-Python
references in bench/reference/ (written the way vLLM v1's Python is), on the seeded
workloads of bench/kv_cache.py and bench/scheduler.py: call-by-call results, block ids,
step-by-step schedules. The benchmarks time the two on these workloads; here they are
only compared."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from pyengine import KVCacheManager, Scheduler, replay_requests

BenchModule = Callable[[str], ModuleType]


def first_difference(ours: list[Any], theirs: list[Any]) -> int | None:
    """The index of the first call whose results differ, or None where none does."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kv_cache_manager_decides_as_the_python_reference(
    bench_module: BenchModule, seed: int
) -> None:
    """The allocate/free workload (shared system prompts, a pool too small for the live
    requests: evictions and preemptions): every call's result, the prefix hits, the
    preemptions and evictions are the same, and all blocks are free at the end."""
    bench = bench_module("kv_cache")
    reference = bench_module("reference.kv_cache_manager")
    workload = bench.make_workload(300, seed)
    ours = KVCacheManager(workload.num_blocks, bench.BLOCK_SIZE, enable_prefix_caching=True)
    theirs = reference.PyKVCacheManager(workload.num_blocks, bench.BLOCK_SIZE)
    got = bench.run_workload(ours, workload, record=True)
    want = bench.run_workload(theirs, workload, record=True)
    assert first_difference(got.trace, want.trace) is None
    assert (got.num_ops, got.num_hit_tokens, got.num_preemptions) == (
        want.num_ops,
        want.num_hit_tokens,
        want.num_preemptions,
    )
    assert ours.stats().num_evictions == theirs.num_evictions
    assert ours.num_free_blocks == theirs.num_free_blocks == workload.num_blocks
    # The workload reaches what it is there for: hits, evictions and preemptions.
    assert got.num_hit_tokens > 0 and got.num_preemptions > 0 and theirs.num_evictions > 0


class RecordingTables:
    """A KV-cache manager whose every allocation also records every group's table of
    the request (block ids, -1 where a window released one)."""

    def __init__(self, manager: Any, num_groups: int) -> None:
        self.manager, self.num_groups = manager, num_groups
        self.tables: list[list[list[int]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)

    def allocate_slots(self, request_id: str, *args: Any) -> Any:
        new_blocks = self.manager.allocate_slots(request_id, *args)
        groups = range(self.num_groups)
        self.tables.append([list(self.manager.block_table(request_id, g)) for g in groups])
        return new_blocks


HYBRID_GROUPS = [("full", 0), ("sliding", 64), ("chunked", 256), ("sliding", 40)]


@pytest.mark.parametrize("seed", [0, 1])
def test_kv_cache_manager_with_kv_groups_decides_as_the_python_reference(
    bench_module: BenchModule, seed: int
) -> None:
    """The same workload over KV-cache groups of full attention, two windows and chunked
    attention: every call's result and every group's table after each allocation (the
    blocks a window released, the prefix hits every group verified) are the same."""
    bench = bench_module("kv_cache")
    reference = bench_module("reference.kv_cache_manager")
    workload = bench.make_workload(200, seed)
    ours = RecordingTables(
        KVCacheManager(workload.num_blocks, bench.BLOCK_SIZE, enable_prefix_caching=True,
                       kv_groups=HYBRID_GROUPS),
        len(HYBRID_GROUPS),
    )  # fmt: skip
    theirs = RecordingTables(
        reference.PyKVCacheManager(workload.num_blocks, bench.BLOCK_SIZE, kv_groups=HYBRID_GROUPS),
        len(HYBRID_GROUPS),
    )
    got = bench.run_workload(ours, workload, record=True)
    want = bench.run_workload(theirs, workload, record=True)
    assert first_difference(got.trace, want.trace) is None
    assert first_difference(ours.tables, theirs.tables) is None
    assert (got.num_hit_tokens, got.num_preemptions) == (want.num_hit_tokens, want.num_preemptions)
    assert ours.stats().num_evictions == theirs.num_evictions
    assert ours.num_free_blocks == theirs.num_free_blocks == workload.num_blocks
    assert got.num_hit_tokens > 0 and got.num_preemptions > 0 and theirs.num_evictions > 0
    # The windows released blocks (-1 in their tables) while the full group kept all.
    assert any(-1 in tables[1] for tables in ours.tables)
    assert all(-1 not in tables[0] for tables in ours.tables)


class RecordingStateSlots(RecordingTables):
    """A KV-cache manager whose every allocation also records the request's state slot."""

    def allocate_slots(self, request_id: str, *args: Any) -> Any:
        new_blocks = self.manager.allocate_slots(request_id, *args)
        self.tables.append([[self.manager.state_slot(request_id)]])
        return new_blocks


def test_kv_cache_manager_with_state_slots_decides_as_the_python_reference(
    bench_module: BenchModule,
) -> None:
    """The workload with recurrent-state slots (no prefix caching: hits need state
    checkpoints), fewer than its live requests: every call's result and every request's
    slot after each allocation are the same, and every slot is free at the end."""
    bench = bench_module("kv_cache")
    reference = bench_module("reference.kv_cache_manager")
    workload = bench.make_workload(200, 0)
    slots = max(2, workload.window // 2)
    ours = RecordingStateSlots(
        KVCacheManager(workload.num_blocks, bench.BLOCK_SIZE, enable_prefix_caching=False,
                       num_state_slots=slots),
        1,
    )  # fmt: skip
    theirs = RecordingStateSlots(
        reference.PyKVCacheManager(workload.num_blocks, bench.BLOCK_SIZE,
                                   enable_prefix_caching=False, num_state_slots=slots),
        1,
    )  # fmt: skip
    got = bench.run_workload(ours, workload, record=True)
    want = bench.run_workload(theirs, workload, record=True)
    assert first_difference(got.trace, want.trace) is None
    assert first_difference(ours.tables, theirs.tables) is None
    assert got.num_preemptions == want.num_preemptions > 0
    assert ours.num_free_state_slots == len(theirs.free_state_slots) == slots
    # (every slot served; -1 only where an allocation found none free)
    assert {t[0][0] for t in ours.tables} - {-1} == set(range(slots))


@pytest.mark.parametrize("seed", [0, 1])
def test_kv_cache_workload_driven_from_cpp_counts_as_the_python_reference(
    bench_module: BenchModule, seed: int
) -> None:
    """replay_requests (the same workload driven from C++, no Python call per operation)
    makes as many calls, hits and preemptions as the Python reference."""
    bench = bench_module("kv_cache")
    reference = bench_module("reference.kv_cache_manager")
    workload = bench.make_workload(300, seed)
    want = bench.run_workload(
        reference.PyKVCacheManager(workload.num_blocks, bench.BLOCK_SIZE), workload
    )
    manager = KVCacheManager(workload.num_blocks, bench.BLOCK_SIZE, enable_prefix_caching=True)
    prompts = bench.ragged([r.prompt_token_ids for r in workload.requests])
    decodes = bench.ragged([r.decode_token_ids for r in workload.requests])
    got = replay_requests(manager, *prompts, *decodes, workload.window)
    assert (got["num_ops"], got["num_hit_tokens"], got["num_preemptions"]) == (
        want.num_ops,
        want.num_hit_tokens,
        want.num_preemptions,
    )
    assert manager.num_free_blocks == workload.num_blocks


@pytest.mark.parametrize("seed", [0, 1])
def test_scheduler_decides_as_the_python_reference(bench_module: BenchModule, seed: int) -> None:
    """The scheduler cross-check's workloads (pools small enough to preempt often, with and
    without chunked prefill, a long-prefill threshold, EOS, stop tokens, min_tokens,
    max_tokens, max_model_len and aborts): the same outputs and finish reasons, the same
    step-by-step schedule and block ids, the same preemptions; and every finished request's
    output is the fake model run on it alone (an aborted one's a prefix of it)."""
    bench = bench_module("scheduler")
    reference = bench_module("reference.scheduler")
    for i, config in enumerate(bench.CHECK_CONFIGS):
        workload = bench.make_check_workload(40, seed + i)
        ours = bench.drive(Scheduler, config, workload)
        theirs = bench.drive(reference.PyScheduler, config, workload)
        assert ours.outputs == theirs.outputs, config
        step = first_difference(ours.schedule_trace, theirs.schedule_trace)
        assert step is None, f"{config}: the schedules differ from step {step}"
        step = first_difference(ours.block_trace, theirs.block_trace)
        assert step is None, f"{config}: the block ids differ from step {step}"
        assert ours.num_preemptions == theirs.num_preemptions, config
        assert bench.matches_reference(ours, workload), config
        assert bench.matches_reference(theirs, workload), config
