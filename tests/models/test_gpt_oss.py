"""gpt-oss (GptOssForCausalLM) on tiny random checkpoints that transformers makes in the
test: attention with biases, learned sinks (drawn large enough to matter) and 16-token
windows on alternating layers, YaRN rope, experts with biases and the clamped SwiGLU (at
a limit the random products pass), a router with a bias. Greedy float32 tokens and
logits identical to transformers', with chunked prefill and forced preemption; over two
ranks, with and without expert parallelism, one rank's tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.hf_reference import (
    assert_preemption_keeps_tokens,
    assert_ranks_give_one_ranks_tokens,
    assert_tokens_and_logits_match,
    prefill_logits,
)
from helpers.tiny_gpt_oss import random_gpt_oss

from pyengine import LLM

transformers = pytest.importorskip("transformers")

ENGINE = dict(max_model_len=256, kv_cache_memory=32 * 2**20, dtype="float32")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("gpt_oss")
    model = random_gpt_oss()
    model.save_pretrained(folder)
    return folder, model


def test_greedy_tokens_and_logits_match_transformers(gpt_oss) -> None:  # type: ignore[no-untyped-def]
    folder, model = gpt_oss
    llm = LLM(str(folder), max_num_batched_tokens=32, **ENGINE)  # (chunked prefill)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    layers = runner.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [16, 0]
    assert layers[0].mlp.weight_form() == "float32 expert panels"
    assert runner.graphs is not None  # (its decode steps recorded: kernels only)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 20, 90)]
    tokens = rng.integers(0, 256, 70).tolist()  # (past the window)
    theirs = assert_tokens_and_logits_match(llm, model, prompts, tokens)
    # (the sinks matter: without them the logits differ)
    for layer in layers:
        layer.self_attn.attn.sinks = None
    assert (prefill_logits(llm, tokens) - theirs).abs().max().item() > 1e-2


def test_preemption_keeps_the_tokens(gpt_oss) -> None:  # type: ignore[no-untyped-def]
    folder, model = gpt_oss
    assert_preemption_keeps_tokens(folder, model, [("sliding", 16), ("full", 0)], ENGINE)


@pytest.mark.slow
def test_two_ranks_give_one_ranks_tokens(gpt_oss) -> None:  # type: ignore[no-untyped-def]
    """The heads and their sinks split, the experts split by size (48 into 24s) or placed
    whole (4 of 8 each); the down biases added once."""
    folder, _ = gpt_oss
    layouts = [{"tensor_parallel_size": 2},
               {"tensor_parallel_size": 2, "enable_expert_parallel": True}]  # fmt: skip
    assert_ranks_give_one_ranks_tokens(folder, ENGINE, layouts)


def test_other_quantizations_and_adapters_are_refused_by_name(gpt_oss, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import json

    folder, _ = gpt_oss
    with pytest.raises(ValueError, match="LoRA adapters on mixture-of-experts layers"):
        LLM(str(folder), enable_lora=True, **ENGINE)
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"gpt-oss with gptq 4-bit, groups of 32 weights is not"):
        LLM(str(tmp_path), **ENGINE)
