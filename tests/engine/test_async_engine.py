"""The engine thread behind the server: callers that give up do not take it down."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from helpers.tiny_models import TINY_LLAMA

from pyengine import SamplingParams
from pyengine.engine.async_engine import AsyncLLMEngine
from pyengine.engine.engine_args import EngineArgs


def tiny_engine(folder: Path, step_timeout: float | None = None) -> AsyncLLMEngine:
    """An AsyncLLMEngine (not started) of a tiny Llama with random weights."""
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    args = EngineArgs(str(folder), load_format="dummy", dtype="float32", max_model_len=256)
    return AsyncLLMEngine(args.create_engine(), step_timeout=step_timeout)


def test_an_add_cancelled_while_queued_is_dropped_and_the_engine_serves_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that stops waiting for add_request (a client that disconnected) while the
    engine thread is inside a step: the request never runs, the one in flight finishes,
    and the engine takes new requests."""
    engine = tiny_engine(tmp_path)
    step = engine.engine.step
    monkeypatch.setattr(engine.engine, "step", lambda *a: time.sleep(0.2) or step(*a))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run() -> list[int]:
        busy = await engine.add_request("busy", [1, 2, 3], greedy)
        await asyncio.sleep(0.05)  # the engine thread is in a step now
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.add_request("gone", [4, 5], greedy), 0.05)
        async for update in busy:
            assert update.request_id == "busy"
        later = await engine.add_request("later", [1, 2, 3], greedy)
        return [t async for update in later for sample in update.samples for t in sample.token_ids]

    engine.start()
    try:
        tokens = asyncio.run(run())
        assert engine.is_running and len(tokens) == 4
        assert "gone" not in engine.engine.requests
        assert engine.engine.scheduler.kv_cache.stats().num_used_blocks == 0
    finally:
        engine.stop()


def test_a_step_past_its_timeout_is_a_hang_until_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that runs past step_timeout: unhealthy, and new requests refused with
    EngineDeadError while it runs; once it ends, healthy and serving again."""
    from pyengine.engine.async_engine import EngineDeadError

    engine = tiny_engine(tmp_path, step_timeout=0.3)
    step = engine.engine.step
    stalls = [1.2]  # (the first step stalls, the others run as usual)
    monkeypatch.setattr(
        engine.engine, "step", lambda *a: time.sleep(stalls.pop() if stalls else 0) or step(*a)
    )
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def run() -> tuple[bool, bool, int]:
        stalled = await engine.add_request("stalled", [1, 2, 3], greedy)
        await asyncio.sleep(0.6)  # past the timeout, inside the stall
        healthy_during = engine.check_health()
        with pytest.raises(EngineDeadError, match="past its timeout of 0.3 s"):
            await engine.add_request("refused", [4, 5], greedy)
        tokens = [t async for u in stalled for s in u.samples for t in s.token_ids]
        later = await engine.add_request("later", [1, 2, 3], greedy)
        more = [t async for u in later for s in u.samples for t in s.token_ids]
        return healthy_during, engine.check_health(), len(tokens) + len(more)

    engine.start()
    try:
        during, after, count = asyncio.run(run())
        assert not during and after and count == 6
        assert engine.engine.scheduler.kv_cache.stats().num_used_blocks == 0
    finally:
        engine.stop()


def test_a_failed_step_ends_its_requests_with_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose execution raises: its request's stream ends with EngineStepError
    naming the cause, nothing is held, and the engine serves the next request."""
    from pyengine.engine.async_engine import EngineStepError

    engine = tiny_engine(tmp_path)
    executor = engine.engine.executor
    execute = executor.execute_model
    faults = [RuntimeError("injected fault")]

    def failing(step):  # type: ignore[no-untyped-def]
        if faults:
            raise faults.pop()
        return execute(step)

    monkeypatch.setattr(executor, "execute_model", failing)
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def run() -> int:
        failed = await engine.add_request("failed", [1, 2, 3], greedy)
        with pytest.raises(EngineStepError, match="request failed failed: RuntimeError: injected"):
            async for _ in failed:
                pass
        later = await engine.add_request("later", [1, 2, 3], greedy)
        return len([t async for u in later for s in u.samples for t in s.token_ids])

    engine.start()
    try:
        assert asyncio.run(run()) == 3
        assert engine.check_health()
        assert engine.engine.scheduler.kv_cache.stats().num_used_blocks == 0
    finally:
        engine.stop()
