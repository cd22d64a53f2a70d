"""Tiny random-weight checkpoints of every supported architecture, made by transformers
in the test: pyengine loads the saved folder and matches transformers' logits and greedy
tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.hf_reference import hf_greedy, prefill_logits
from helpers.tiny_models import CONFIGS, make_checkpoint

from pyengine import LLM, SamplingParams
from pyengine.layers.quantization.unquantized import BF16PanelsMethod
from pyengine.layers.vocab_embedding import ParallelLMHead

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp(request.param)
    return folder, make_checkpoint(request.param, folder)


def test_logits_match_transformers(checkpoint) -> None:  # type: ignore[no-untyped-def]
    folder, model = checkpoint
    llm = LLM(str(folder), max_model_len=256, kv_cache_memory=64 * 2**20, dtype="float32")
    tokens = np.random.default_rng(1).integers(0, 256, 150).tolist()
    ours = prefill_logits(llm, tokens)
    with torch.inference_mode():
        theirs = model(torch.tensor([tokens])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4


def test_greedy_tokens_match_transformers(checkpoint) -> None:  # type: ignore[no-untyped-def]
    folder, model = checkpoint
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n).tolist() for n in (1, 5, 17, 40, 90, 130)]
    llm = LLM(
        str(folder),
        max_model_len=256,
        kv_cache_memory=64 * 2**20,
        max_num_batched_tokens=64,
        dtype="float32",
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 12)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_a_16_bit_kv_cache_under_float32_weights(checkpoint, kv_cache_dtype: str) -> None:  # type: ignore[no-untyped-def]
    """kv_cache_dtype on the CPU: twice the blocks in the same memory, and logits within
    the cache dtype's rounding of float32 transformers'."""
    folder, model = checkpoint
    memory = 64 * 2**20
    llm = LLM(
        str(folder),
        max_model_len=256,
        kv_cache_memory=memory,
        kv_cache_dtype=kv_cache_dtype,
        dtype="float32",
    )
    full = LLM(str(folder), max_model_len=256, kv_cache_memory=memory, dtype="float32")
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert runner.caches[0][0].dtype == getattr(torch, kv_cache_dtype)
    assert runner.num_blocks == 2 * full.llm_engine.executor.driver_worker.model_runner.num_blocks
    tokens = np.random.default_rng(1).integers(0, 256, 150).tolist()
    ours = prefill_logits(llm, tokens)
    with torch.inference_mode():
        theirs = model(torch.tensor([tokens])).logits[0]
    error = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert 0 < error < {"bfloat16": 0.02, "float16": 0.003}[kv_cache_dtype]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_logits_are_close_to_transformers_float32(checkpoint, dtype: str) -> None:  # type: ignore[no-untyped-def]
    """16-bit weights, activations and KV cache (float16: the path a GPU takes, torch's
    matmul, run on the CPU; bfloat16: the CPU's bfloat16 panels): the logits stay within
    16-bit rounding of float32 transformers'."""
    folder, model = checkpoint
    llm = LLM(str(folder), max_model_len=256, kv_cache_memory=64 * 2**20, dtype=dtype)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert runner.caches[0][0].dtype == getattr(torch, dtype)
    tokens = np.random.default_rng(1).integers(0, 256, 150).tolist()
    ours = prefill_logits(llm, tokens)
    with torch.inference_mode():
        theirs = model(torch.tensor([tokens])).logits[0]
    error = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert error < {"bfloat16": 0.03, "float16": 0.005}[dtype]  # about 2x what they give


def test_bfloat16_weights_are_held_only_as_bfloat16_panels(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """dtype bfloat16 on the CPU: each linear layer's weight only as pyengine's bfloat16
    panels (2 bytes a weight, no float copy), a tied embedding looking its rows up in the
    head's panels."""
    folder, _ = checkpoint
    llm = LLM(str(folder), max_model_len=256, kv_cache_memory=64 * 2**20, dtype="bfloat16")
    model = llm.llm_engine.executor.driver_worker.model_runner.model
    linear = [m for m in model.modules() if hasattr(m, "method")]
    assert linear
    for layer in linear:
        assert isinstance(layer.method, BF16PanelsMethod)
        assert layer.method_state.panels.dtype == torch.bfloat16
        assert "weight" not in layer._parameters
    for head in (m for m in model.modules() if isinstance(m, ParallelLMHead)):
        if head.tied_to is not None:
            assert head.tied_to.packed is head.method_state.panels
            assert not hasattr(head.tied_to, "weight")
    llm.llm_engine.shutdown()
