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


def test_an_add_cancelled_while_queued_is_dropped_and_the_engine_serves_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that stops waiting for add_request (a client that disconnected) while the
    engine thread is inside a step: the request never runs, the one in flight finishes,
    and the engine takes new requests."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    args = EngineArgs(str(tmp_path), load_format="dummy", dtype="float32", max_model_len=256)
    engine = AsyncLLMEngine(args.create_engine())
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
