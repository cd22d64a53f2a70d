"""KVCacheManager through the bindings: behaviour, statistics and errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.collisions import colliding_block

from pyengine import KVCacheManager, compute_block_keys


def start(kv: KVCacheManager, request: str, prompt: list[int], **extras: object) -> int:
    """Adds a request, schedules its whole prompt, returns the prefix-hit length."""
    kv.add_request(request, prompt, **extras)
    hit = kv.get_computed_blocks(request)
    assert (
        kv.allocate_slots(request, len(prompt) - hit.num_computed_tokens, computed=hit) is not None
    )
    return hit.num_computed_tokens


def state(kv: KVCacheManager) -> tuple[object, ...]:
    s = kv.stats()
    return (
        s.num_free_blocks,
        s.num_cached_blocks,
        s.prefix_cache_queries,
        kv.num_requests,
        kv.pool.free_blocks_in_order(),
    )


def test_prefix_sharing_and_statistics() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(100, 110))
    assert start(kv, "a", prompt) == 0
    assert start(kv, "b", prompt + [7, 7]) == 8
    assert kv.block_table("a")[:2] == kv.block_table("b")[:2]
    s = kv.stats()
    assert (s.num_used_blocks, s.num_free_blocks, s.num_cached_blocks) == (4, 12, 3)
    assert s.prefix_cache_queries == 22 and s.prefix_cache_hits == 8
    assert s.prefix_cache_hit_rate == pytest.approx(8 / 22)
    assert s.usage == pytest.approx(4 / 16)
    assert s.internal_waste_tokens == 4 * 4 - (10 + 4)  # b's third block holds 4 of its own
    assert "num_used_blocks=4" in repr(s)
    kv.free("a")
    kv.free("b")
    assert kv.stats().num_used_blocks == 0
    assert kv.stats().num_cached_blocks == 3  # freed blocks stay cached


def test_numpy_prompts_of_any_integer_dtype() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    start(kv, "a", np.arange(9, dtype=np.int32))  # type: ignore[arg-type]
    assert start(kv, "b", np.arange(9, dtype=np.int64)) == 8  # type: ignore[arg-type]
    assert start(kv, "c", np.arange(9, dtype=np.uint16)) == 8  # type: ignore[arg-type]
    assert kv.token_ids("c") == list(range(9))


def test_cache_salt_and_adapter_isolate_requests() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(12))
    start(kv, "a", prompt, cache_salt="alice")
    assert start(kv, "b", prompt, cache_salt="bob") == 0
    assert start(kv, "c", prompt, cache_salt="alice", adapter_id=2) == 0
    assert start(kv, "d", prompt, cache_salt="alice") == 8


def test_without_prefix_caching_nothing_is_shared() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    start(kv, "a", list(range(9)))
    assert start(kv, "b", list(range(9))) == 0
    assert kv.stats().num_cached_blocks == 0


@pytest.mark.parametrize("block_size", [0, -16, 3, 12, 17])
def test_block_size_must_be_a_power_of_two(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size must be a positive power of two"):
        KVCacheManager(num_blocks=8, block_size=block_size, enable_prefix_caching=True)


def test_the_binding_takes_every_argument() -> None:
    """The engine's defaults live in EngineArgs alone, none in the binding."""
    with pytest.raises(TypeError):
        KVCacheManager(num_blocks=8)  # type: ignore[call-arg]


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_num_blocks_must_be_positive(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        KVCacheManager(num_blocks=num_blocks, block_size=16, enable_prefix_caching=True)


def test_bad_requests_raise_and_change_nothing() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    start(kv, "a", list(range(6)))
    before = state(kv)
    with pytest.raises(KeyError, match="unknown request id 'nobody'"):
        kv.allocate_slots("nobody", 1)
    with pytest.raises(KeyError, match="unknown request id"):
        kv.block_table("nobody")
    with pytest.raises(ValueError, match="num_new_tokens must be positive"):
        kv.allocate_slots("a", 0)
    with pytest.raises(ValueError, match="num_new_tokens must be positive"):
        kv.allocate_slots("a", -2)
    with pytest.raises(ValueError, match="num_lookahead must be non-negative"):
        kv.allocate_slots("a", 1, num_lookahead=-1)
    with pytest.raises(ValueError, match="only 6 tokens are known"):
        kv.allocate_slots("a", 1)
    with pytest.raises(ValueError, match="already exists"):
        kv.add_request("a", [1, 2])
    with pytest.raises(ValueError, match="prompt is empty"):
        kv.add_request("e", [])
    with pytest.raises(ValueError, match="outside"):
        kv.add_request("e", [1, -5])
    with pytest.raises(ValueError, match="outside"):
        kv.add_request("e", [2**31])
    with pytest.raises(ValueError, match="outside"):
        kv.add_request("e", np.array([1, 2**40]))
    with pytest.raises(ValueError, match="integer dtype"):
        kv.add_request("e", np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="must be 1-D"):
        kv.add_request("e", np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(TypeError, match="must hold ints"):
        kv.add_request("e", [1, "2"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="must be a list"):
        kv.add_request("e", "abc")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="already has blocks"):
        kv.get_computed_blocks("a")
    with pytest.raises(ValueError, match="already exists"):
        kv.fork("a", "a")
    with pytest.raises(ValueError, match="out of range"):
        kv.pool.ref_count(8)
    assert state(kv) == before
    assert not kv.has_request("e")


def test_freeing_twice_is_an_error() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    start(kv, "a", list(range(6)))
    kv.free("a")
    with pytest.raises(KeyError, match="unknown request id 'a'"):
        kv.free("a")
    assert kv.num_free_blocks == 4


def test_running_out_of_blocks_returns_none_and_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    start(kv, "a", list(range(8)))
    kv.add_request("b", list(range(50, 62)))
    before = state(kv)
    assert not kv.can_allocate_slots("b", 12)
    assert kv.allocate_slots("b", 12) is None
    assert state(kv) == before
    assert kv.allocate_slots("b", 4) == [2]  # a smaller chunk fits


def test_fork_copy_on_write() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    start(kv, "p", list(range(6)))
    kv.fork("p", "c")
    shared = kv.block_table("p")
    kv.append_token_ids("c", [9])
    assert kv.allocate_slots("c", 1) == []
    [(src, dst)] = kv.take_pending_copies()
    assert src == shared[1] and kv.block_table("c") == [shared[0], dst]
    assert kv.take_pending_copies() == []


def test_eviction_is_least_recently_freed_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    start(kv, "a", [1, 2, 3])  # blocks 0, 1
    start(kv, "b", [5, 6, 7])  # blocks 2, 3
    kv.free("a")
    kv.free("b")
    # Freed tail blocks first: 1 (a's partial), 0, 3, 2; block 0 and 2 stay cached. The
    # uncached ones are taken most recently freed first: 3, then 1.
    assert kv.pool.free_blocks_in_order() == [3, 1, 0, 2]
    start(kv, "c", [9, 9, 9, 9, 9])  # needs 3 blocks: 3, 1, then evicts 0
    assert kv.stats().num_evictions == 1
    kv.free("c")
    assert start(kv, "d", [5, 6, 7]) == 2  # b's first block survived
    assert kv.block_table("d")[0] == 2


def test_colliding_keys_never_serve_another_prefix() -> None:
    """Regression: allocate_slots trusted a hit's key; a block evicted and re-cached
    under the same (collided) key with other tokens was taken as the hit."""
    ours = list(range(100, 116))
    theirs = colliding_block(ours)
    assert theirs != ours
    np.testing.assert_array_equal(compute_block_keys(ours), compute_block_keys(theirs))

    kv = KVCacheManager(num_blocks=2, block_size=16, enable_prefix_caching=True)
    start(kv, "a", ours)  # caches `ours` in block 0
    kv.add_request("z", [7])
    kv.allocate_slots("z", 1)  # holds block 1
    kv.free("a")
    kv.add_request("v", [*ours, 5])
    hit = kv.get_computed_blocks("v")
    assert hit.block_ids == [0]
    assert start(kv, "b", theirs) == 0  # same key, other tokens: verified as a miss...
    kv.free("b")  # ... and it evicted block 0 and cached `theirs` there under the key
    kv.free("z")
    with pytest.raises(ValueError, match="computed blocks are stale"):
        kv.allocate_slots("v", 1, computed=hit)
    assert kv.block_table("v") == []
    assert start(kv, "w", [*theirs, 1]) == 16  # the real owner of the key still hits


def test_a_failed_add_request_registers_nothing(tmp_path: Path) -> None:
    """Regression: add_request took a slot (with the previous owner's block table)
    under the new id before copying the prompt; a MemoryError left the id registered."""
    script = """
import resource, numpy as np
from pyengine import KVCacheManager
kv = KVCacheManager(num_blocks=1, block_size=4, enable_prefix_caching=True)
kv.add_request("old", [1, 2, 3]); kv.add_request("keep", [4, 5, 6])
kv.allocate_slots("old", 3); kv.free("old"); kv.allocate_slots("keep", 3)
big = np.ones(50_000_000, dtype=np.int32)
vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 100 * 2**20, resource.RLIM_INFINITY))
try:
    kv.add_request("big", big)
    raise SystemExit("expected MemoryError")
except MemoryError:
    pass
try:
    kv.fork("keep", "child")
except MemoryError:
    pass
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
assert not kv.has_request("big") and kv.num_requests in (1, 2)
assert kv.pool.ref_count(0) == kv.num_requests, kv.pool.ref_count(0)
print("ok")
"""
    # Not from the source tree, whose pyengine/ would shadow the installed package.
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_misaligned_token_arrays_are_copied() -> None:
    raw = np.arange(17, dtype=np.int32).tobytes()
    misaligned = np.frombuffer(b"\0" + raw, dtype=np.int32, offset=1)
    assert misaligned.ctypes.data % 4 != 0
    expected = compute_block_keys(np.arange(17, dtype=np.int32), 4)
    np.testing.assert_array_equal(compute_block_keys(misaligned, 4), expected)


def test_rollback_into_blocks_another_request_shares_is_refused() -> None:
    """b's prefix hit shares a's first two blocks: rolling b (or a) back into them would
    take them out of the prefix index under the other request. Refused, nothing changed."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    kv.add_request("a", list(range(9)))
    kv.allocate_slots("a", 9)
    kv.add_request("b", list(range(10)))
    hit = kv.get_computed_blocks("b")
    assert hit.num_computed_tokens == 8
    kv.allocate_slots("b", 2, 0, hit)
    for request in ("b", "a"):
        with pytest.raises(ValueError, match="inside blocks other requests share"):
            kv.rollback(request, 0)
    kv.rollback("b", 8)  # b's own block only
    kv.free("b")
    kv.rollback("a", 0)  # a alone holds them now
    kv.free("a")
    assert kv.stats().num_used_blocks == 0
