"""replay_requests (the manager driven natively) against the same workload driven from
Python, call by call, on a second manager."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from pyengine import KVCacheManager, replay_requests


def drive_from_python(
    kv: KVCacheManager, prompts: list[list[int]], decodes: list[list[int]], max_live: int
) -> dict[str, int]:
    live: deque[str] = deque()
    stats = {"num_ops": 0, "num_hit_tokens": 0, "num_preemptions": 0}

    def free_oldest() -> None:
        kv.free(live.popleft())
        stats["num_ops"] += 1

    def allocate(request: str, num_new: int, hit: object = None) -> None:
        while True:
            done = kv.allocate_slots(request, num_new, 0, hit) is not None
            stats["num_ops"] += 1
            if done:
                return
            assert live[0] != request, "does not fit"
            free_oldest()
            stats["num_preemptions"] += 1

    for i, (prompt, decode) in enumerate(zip(prompts, decodes, strict=True)):
        request = f"req-{i}"
        kv.add_request(request, prompt)
        live.append(request)
        hit = kv.get_computed_blocks(request)
        stats["num_ops"] += 2
        stats["num_hit_tokens"] += hit.num_computed_tokens
        allocate(request, len(prompt) - hit.num_computed_tokens, hit)
        for token in decode:
            kv.append_token_ids(request, [token])
            stats["num_ops"] += 1
            allocate(request, 1)
        if len(live) > max_live:
            free_oldest()
    while live:
        free_oldest()
    return stats


def ragged(sequences: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    start_loc = np.concatenate([[0], np.cumsum([len(s) for s in sequences])]).astype(np.int64)
    flat = np.array([t for s in sequences for t in s], dtype=np.int32)
    return flat, start_loc


def test_native_replay_matches_python_driving() -> None:
    rng = np.random.default_rng()
    shared = rng.integers(0, 50, 40).tolist()
    prompts = [
        (shared[: rng.integers(0, 40)] if rng.random() < 0.5 else [])
        + rng.integers(0, 50, rng.integers(1, 60)).tolist()
        for _ in range(300)
    ]
    decodes = [rng.integers(0, 50, rng.integers(0, 6)).tolist() for _ in prompts]
    native_kv = KVCacheManager(40, 4, enable_prefix_caching=True)
    python_kv = KVCacheManager(40, 4, enable_prefix_caching=True)
    native = replay_requests(native_kv, *ragged(prompts), *ragged(decodes), 6)
    expected = drive_from_python(python_kv, prompts, decodes, 6)
    assert native == expected
    assert native["num_hit_tokens"] > 0 and native["num_preemptions"] > 0
    assert native_kv.stats().num_evictions == python_kv.stats().num_evictions
    assert native_kv.num_free_blocks == 40 and native_kv.num_requests == 0


def test_bad_traces_are_rejected() -> None:
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    tokens, loc = ragged([[1, 2, 3], [4, 5]])
    empty, empty_loc = ragged([[], []])
    with pytest.raises(ValueError, match="end at the number of token ids"):
        replay_requests(kv, tokens, [0, 3], empty, empty_loc, 2)
    with pytest.raises(ValueError, match="non-decreasing"):
        replay_requests(kv, tokens, [0, 4, 3, 5], *ragged([[], [], []]), 2)
    with pytest.raises(ValueError, match="differ in number"):
        replay_requests(kv, tokens, loc, *ragged([[]]), 2)
    with pytest.raises(ValueError, match="max_live_requests must be positive"):
        replay_requests(kv, tokens, loc, empty, empty_loc, 0)
    with pytest.raises(RuntimeError, match="does not fit"):
        replay_requests(kv, *ragged([[1] * 40]), *ragged([[]]), 2)
    assert kv.num_free_blocks == 8 and kv.num_requests == 0  # nothing leaked
