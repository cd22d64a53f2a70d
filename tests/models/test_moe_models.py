"""Mixture-of-experts architectures (Qwen3-MoE, Qwen2-MoE, Mixtral) on tiny random checkpoints that
transformers makes in the test (random norms, router and experts too; fewer tokens than
experts, so that some experts get none): greedy float32 tokens and logits identical to
transformers', with chunked prefill and a shared prefix; what the first form cannot run
refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.hf_reference import hf_greedy, prefill_logits

from pyengine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")


SHAPE = {"vocab_size": 256, "max_position_embeddings": 256, "hidden_size": 64,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "num_experts_per_tok": 2, "tie_word_embeddings": False}  # fmt: skip
CONFIGS = {
    # 8 experts, top 2, renormalised; its second layer dense
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SHAPE, intermediate_size=96, moe_intermediate_size=48, num_experts=8,
        norm_topk_prob=True, mlp_only_layers=[1],
    ),
    # 8 experts, top 2, not renormalised, a gated shared expert; q/k/v biases; its first
    # layer dense
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **SHAPE, intermediate_size=96, moe_intermediate_size=48, num_experts=8,
        shared_expert_intermediate_size=80, norm_topk_prob=False, mlp_only_layers=[0],
    ),
    # 6 experts in every layer, always renormalised
    "mixtral": lambda: transformers.MixtralConfig(
        **SHAPE, intermediate_size=48, num_local_experts=6
    ),
}  # fmt: skip
LAYERS = {
    "qwen3_moe": ["FusedMoE", "MLP", "FusedMoE"],
    "qwen2_moe": ["MLP", "FusedMoE", "FusedMoE"],
    "mixtral": ["FusedMoE", "FusedMoE", "FusedMoE"],
}


def moe_checkpoint(kind: str, folder: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](), dtype=torch.float32)
    with torch.no_grad():  # (larger than the default init: the logits say something)
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.08)
    model.eval().save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
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
    # checked against an eager forward when recorded).
    assert layers[2].mlp.weight_form() == "float32 expert panels"
    assert runner.graphs is not None
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


def test_what_the_first_form_cannot_run_is_refused_by_name(checkpoint) -> None:  # type: ignore[no-untyped-def]
    _, folder, _ = checkpoint
    with pytest.raises(ValueError, match="LoRA adapters on mixture-of-experts layers"):
        LLM(str(folder), max_model_len=256, kv_cache_memory=32 * 2**20, enable_lora=True)
