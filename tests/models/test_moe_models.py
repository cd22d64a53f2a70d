"""Mixture-of-experts architectures (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) on tiny random
checkpoints that transformers makes in the test (helpers/tiny_moe.py): greedy float32
tokens and logits identical to transformers', with chunked prefill and a shared prefix;
a checkpoint that lacks an expert's tensor, and what is not built yet, refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.hf_reference import hf_greedy, prefill_logits
from helpers.tiny_moe import MOE_CONFIGS, moe_checkpoint, save_fused
from safetensors import safe_open

from pyengine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")


LAYERS = {
    "qwen3_moe": ["FusedMoE", "MLP", "FusedMoE"],
    "qwen2_moe": ["MLP", "FusedMoE", "FusedMoE"],
    "mixtral": ["FusedMoE", "FusedMoE", "FusedMoE"],
    "olmoe": ["FusedMoE", "FusedMoE", "FusedMoE"],
}


@pytest.fixture(scope="module", params=sorted(MOE_CONFIGS))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, moe_checkpoint(request.param, folder)


def test_greedy_tokens_and_logits_match_transformers(checkpoint) -> None:  # type: ignore[no-untyped-def]
    kind, folder, model = checkpoint
    llm = LLM(str(folder), max_model_len=256, kv_cache_memory=32 * 2**20,
              max_num_batched_tokens=32, dtype="float32")  # fmt: skip
    runner = llm.llm_engine.executor.driver_worker.model_runner
    layers = runner.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == LAYERS[kind]
    # The experts as packed panels, their decode steps recorded kernels (the replay
    # checked against an eager forward when recorded; OLMoE's clip_qkv clamps in torch,
    # which no recording holds: its steps run eagerly).
    assert layers[2].mlp.weight_form() == "float32 expert panels"
    assert (runner.graphs is not None) == (kind != "olmoe")
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 256, 40).tolist()
    prompts = [rng.integers(0, 256, n).tolist() for n in (1, 6, 50)] + [shared, shared + [7, 9]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 10)
    tokens = rng.integers(0, 256, 70).tolist()
    with torch.inference_mode():
        theirs = model(torch.tensor([tokens])).logits[0]
    assert (prefill_logits(llm, tokens) - theirs).abs().max().item() < 1e-4


def test_preemption_and_speculative_decoding_keep_the_tokens(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A KV pool too small for every request at once (requests preempted and computed
    again), and prompt-lookup drafts verified a step at a time: transformers' tokens."""
    _, folder, model = checkpoint
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, n).tolist() for n in (30, 45, 60)]
    prompts += [[7, 8, 9, 10] * 12]  # (repeats: prompt lookup finds drafts)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    block = 3 * 2 * 2 * 32 * 16 * 4  # 3 layers' K and V of 16 tokens, float32
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    for options in ({"kv_cache_memory": 9 * block}, {"speculative_config": spec}):
        llm = LLM(str(folder), max_model_len=128, dtype="float32",
                  **{"kv_cache_memory": 32 * 2**20, **options})  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(model, prompt, 24), options
        if "speculative_config" in options:
            assert llm.llm_engine.core.spec_stats.num_drafts > 0
        else:
            assert llm.llm_engine.scheduler.stats().num_preemptions > 0


def test_every_expert_in_one_tensor_loads_as_one_at_a_time(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    kind, folder, model = checkpoint
    save_fused(model, folder, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert any(name.endswith("mlp.experts.gate_up_proj") for name in f.keys())  # noqa: SIM118
    llm = LLM(str(tmp_path), max_model_len=256, kv_cache_memory=32 * 2**20, dtype="float32")
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(model, prompt, 8)


def test_a_missing_expert_tensor_is_named(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file, save_file

    kind, folder, _ = checkpoint
    tensors = load_file(folder / "model.safetensors")
    missing = next(name for name in sorted(tensors) if ".experts.3." in name)
    del tensors[missing]
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"the checkpoint lacks 1 weights, e.g. \\['{missing}'"):
        LLM(str(tmp_path), max_model_len=256, kv_cache_memory=32 * 2**20)


def test_what_the_first_form_cannot_run_is_refused_by_name(checkpoint) -> None:  # type: ignore[no-untyped-def]
    _, folder, _ = checkpoint
    with pytest.raises(ValueError, match="LoRA adapters on mixture-of-experts layers"):
        LLM(str(folder), max_model_len=256, kv_cache_memory=32 * 2**20, enable_lora=True)
