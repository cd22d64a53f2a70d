"""A model whose every layer attends within a window (Mistral, Phi-3) keeps a request's KV
memory bounded by the window: a pool of five blocks generates 200 tokens after a
40-token prompt, where full attention would need fifteen, with transformers' tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.hf_reference import hf_greedy
from helpers.tiny_models import make_checkpoint

from pyengine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

BLOCK_BYTES = 2 * 2 * 2 * 32 * 16 * 4  # two layers' K and V, two kv heads of 32, 16 tokens


@pytest.mark.parametrize("kind", ["mistral", "phi3"])
def test_a_window_bounds_a_requests_kv_memory(kind: str, tmp_path: Path) -> None:
    model = make_checkpoint(kind, tmp_path)
    llm = LLM(
        str(tmp_path), max_model_len=256, kv_cache_memory=5 * BLOCK_BYTES,
        max_num_batched_tokens=32, enable_chunked_prefill=True, dtype="float32",
    )  # fmt: skip
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert runner.kv_layout.groups == (("sliding", 16),) and runner.num_blocks == 5
    prompt = np.random.default_rng(3).integers(0, 256, 40).tolist()
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(model, prompt, 200)
    assert llm.llm_engine.scheduler.stats().num_preemptions == 0
