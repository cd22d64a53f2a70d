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
    step = engine.llm_engine.step
    monkeypatch.setattr(engine.llm_engine, "step", lambda *a: time.sleep(0.2) or step(*a))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run() -> list[int]:
        busy = await engine.add_request("busy", [1, 2, 3], greedy)
        await asyncio.sleep(0.05)  # the engine thread is in a step now
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.add_request("gone", [4, 5], greedy), 0.05)
        async for update in busy:
            assert update.request_id == "busy"
        later = await engine.add_request("later", [1, 2, 3], greedy)
        return [t async for update in later for sample in update.outputs for t in sample.token_ids]

    engine.start()
    try:
        tokens = asyncio.run(run())
        assert engine.is_running and len(tokens) == 4
        assert "gone" not in engine.llm_engine.requests
        assert engine.llm_engine.scheduler.kv_cache.stats().num_used_blocks == 0
    finally:
        engine.stop()


def test_a_step_past_its_timeout_is_a_hang_until_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that runs past step_timeout: unhealthy, new requests refused with
    EngineDeadError, and its request ended with one, while it runs; once it ends, the
    request is aborted, and the engine healthy and serving again."""
    from pyengine.engine.async_engine import EngineDeadError

    engine = tiny_engine(tmp_path, step_timeout=0.3)
    step = engine.llm_engine.step
    stalls = [1.2]  # (the first step stalls, the others run as usual)
    monkeypatch.setattr(
        engine.llm_engine, "step", lambda *a: time.sleep(stalls.pop() if stalls else 0) or step(*a)
    )
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def run() -> tuple[bool, bool, int]:
        stalled = await engine.add_request("stalled", [1, 2, 3], greedy)
        await asyncio.sleep(0.6)  # past the timeout, inside the stall
        healthy_during = engine.check_health()
        with pytest.raises(EngineDeadError, match="past its timeout of 0.3 s"):
            await engine.add_request("refused", [4, 5], greedy)
        with pytest.raises(EngineDeadError, match="request stalled ended"):
            async for _ in stalled:
                pass
        assert time.monotonic() - start < 1.1  # (before the stalled step ended)
        while engine.stalled_step() is not None:
            await asyncio.sleep(0.05)
        later = await engine.add_request("later", [1, 2, 3], greedy)
        more = [t async for u in later for s in u.outputs for t in s.token_ids]
        return healthy_during, engine.check_health(), len(more)

    engine.start()
    try:
        start = time.monotonic()
        during, after, count = asyncio.run(run())
        assert not during and after and count == 3
        assert "stalled" not in engine.llm_engine.requests
        assert engine.llm_engine.scheduler.kv_cache.stats().num_used_blocks == 0
    finally:
        engine.stop()


def test_a_failed_step_ends_its_requests_with_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose execution raises: its request's stream ends with EngineStepError
    naming the cause, nothing is held, and the engine serves the next request."""
    from pyengine.engine.async_engine import EngineStepError

    engine = tiny_engine(tmp_path)
    executor = engine.llm_engine.executor
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
        # (the error's kind; its text, a worker's traceback maybe, is for the log)
        with pytest.raises(EngineStepError, match=r"request failed failed: RuntimeError \(the"):
            async for _ in failed:
                pass
        later = await engine.add_request("later", [1, 2, 3], greedy)
        return len([t async for u in later for s in u.outputs for t in s.token_ids])

    engine.start()
    try:
        assert asyncio.run(run()) == 3
        assert engine.check_health()
        assert engine.llm_engine.scheduler.kv_cache.stats().num_used_blocks == 0
    finally:
        engine.stop()


def test_a_fault_pinned_on_a_request_fails_it_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that raises a RequestFault naming one of its requests, several times in a
    row: that request alone ends with the fault's message, the step runs again without
    it, the request beside it gets the tokens it gets alone, and the engine stays up."""
    from pyengine.engine.async_engine import EngineStepError
    from pyengine.faults import RequestFault

    engine = tiny_engine(tmp_path)
    executor = engine.llm_engine.executor
    execute = executor.execute_model
    greedy = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    def failing(step):  # type: ignore[no-untyped-def]
        rows = engine.llm_engine.core.schedulers[0].buffers.request_ids
        culprits = tuple(r for r in rows if r.startswith("bad"))
        if culprits:
            raise RequestFault("its input breaks the step", request_ids=culprits)
        return execute(step)

    async def tokens(request_id: str, prompt: list[int]) -> list[int]:
        stream = await engine.add_request(request_id, prompt, greedy)
        return [t async for update in stream for s in update.outputs for t in s.token_ids]

    async def run() -> tuple[list[int], list[int]]:
        alone = await tokens("alone", [5, 6, 7, 8, 9])
        monkeypatch.setattr(executor, "execute_model", failing)
        good = asyncio.ensure_future(tokens("good", [5, 6, 7, 8, 9]))
        await asyncio.sleep(0.02)  # (it runs)
        for k in range(3):
            with pytest.raises(EngineStepError, match=f"bad{k} failed: its input breaks"):
                await tokens(f"bad{k}", [1, 2, 3])
        assert not good.done()  # (the faults came in steps it ran in)
        return alone, await good

    engine.start()
    try:
        alone, good = asyncio.run(run())
        assert good == alone and len(good) == 200
        assert engine.check_health()
        assert engine.llm_engine.scheduler.kv_cache.stats().num_used_blocks == 0
    finally:
        engine.stop()


def test_a_reader_that_falls_behind_holds_one_merged_update(tmp_path: Path) -> None:
    """A stream whose reader takes nothing while its request runs (a client whose socket
    is full): the engine thread does not wait for it, and the stream holds one update,
    every step's news merged into it: the texts, tokens and logprobs a reader that keeps
    up gets, in the same order."""
    from pyengine.outputs import RequestOutput

    engine = tiny_engine(tmp_path)
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=10, ignore_eos=True,
                            logprobs=1)  # fmt: skip

    def joined(updates: list[RequestOutput]) -> dict[int, tuple[str, list[int], int, str]]:
        """Each sample's text, tokens, number of logprobs and finish reason."""
        text: dict[int, str] = {}
        tokens: dict[int, list[int]] = {}
        logprobs: dict[int, int] = {}
        reason: dict[int, str] = {}
        for s in (s for update in updates for s in update.outputs):
            text[s.index] = text.get(s.index, "") + s.text
            tokens[s.index] = tokens.get(s.index, []) + s.token_ids
            logprobs[s.index] = logprobs.get(s.index, 0) + len(s.logprobs or [])
            reason[s.index] = s.finish_reason or ""
        return {k: (text[k], tokens[k], logprobs[k], reason[k]) for k in text}

    async def run() -> tuple[list[RequestOutput], list[RequestOutput]]:
        keeping_up = await engine.add_request("keeping-up", [1, 2, 3], params)
        kept = [update async for update in keeping_up]
        behind = await engine.add_request("behind", [1, 2, 3], params)
        deadline = time.monotonic() + 30
        while "behind" in engine.llm_engine.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # (it runs to its end, unread)
        return kept, [update async for update in behind]

    engine.start()
    try:
        kept, merged = asyncio.run(run())
        assert len(kept) > 1 and len(merged) == 1 and merged[0].finished
        assert joined(merged) == joined(kept)
        assert [len(joined(kept)[k][1]) for k in (0, 1)] == [10, 10]
        assert engine.llm_engine.scheduler.kv_cache.stats().num_used_blocks == 0
    finally:
        engine.stop()
