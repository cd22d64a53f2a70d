"""Tiny mixture-of-experts checkpoints that transformers makes (random norms, router,
experts and biases; fewer tokens than experts in the tests' prompts, so that some experts
get none), for the model and distributed tests."""

from __future__ import annotations

from pathlib import Path

import torch

try:
    import transformers
except ImportError:  # the tests that make checkpoints skip on their own importorskip
    transformers = None

SHAPE = {"vocab_size": 256, "max_position_embeddings": 256, "hidden_size": 64,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "num_experts_per_tok": 2, "tie_word_embeddings": False}  # fmt: skip
MOE_CONFIGS = {
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
    # 8 experts in every layer, not renormalised; q/k norms over each whole projection,
    # q, k and v clamped (at a bound that the random weights' q and k pass)
    # (its norms take hidden_size / heads as the head size: no head_dim of its own)
    "olmoe": lambda: transformers.OlmoeConfig(
        **{**{k: v for k, v in SHAPE.items() if k != "head_dim"}, "hidden_size": 128},
        intermediate_size=48, num_experts=8, norm_topk_prob=False, clip_qkv=1.2,
    ),
}  # fmt: skip


def moe_checkpoint(kind: str, folder: Path, **overrides: object) -> torch.nn.Module:
    """A random float32 checkpoint of MOE_CONFIGS[kind] (norms, router, experts and
    biases too; `overrides` of its config's values), saved to folder; the model."""
    torch.manual_seed(0)
    config = MOE_CONFIGS[kind]()
    for key, value in overrides.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # (larger than the default init: the logits say something)
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.08)
    model.eval().save_pretrained(folder)
    return model


def save_fused(model: torch.nn.Module, source: Path, folder: Path) -> None:
    """`model`'s weights as transformers 5 holds them (every expert of a layer in one
    tensor: mlp.experts.gate_up_proj and down_proj) in `folder`, with `source`'s other
    files (config, tokenizer)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
