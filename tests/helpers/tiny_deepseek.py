"""Tiny random DeepSeek-V2/V3 checkpoints that transformers makes: random norms, router
and correction bias too (so that a skipped term shows)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SHAPE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8,
    num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
    topk_group=2, routed_scaling_factor=1.5, max_position_embeddings=256,
    tie_word_embeddings=False,
)  # fmt: skip
V3_YARN = {
    "rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8,
    "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
    "rope_theta": 10000.0,
}  # fmt: skip


def deepseek_config(version: str, **overrides: Any) -> Any:
    """V2 (q_proj whole, softmax limited to the top groups) or V3 (q_lora_rank, YaRN with
    mscale_all_dim, sigmoid routing), with SHAPE's sizes unless overridden."""
    import transformers

    shape = {**SHAPE, **overrides}
    if version == "v2":
        shape.setdefault("q_lora_rank", None)
        return transformers.DeepseekV2Config(
            **shape, topk_method="group_limited_greedy", norm_topk_prob=False
        )
    shape.setdefault("q_lora_rank", 48)
    return transformers.DeepseekV3Config(**shape, norm_topk_prob=True, rope_parameters=V3_YARN)


def random_deepseek(config: Any) -> Any:
    """A model of `config` (float32, eval), every parameter random (seed 0)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.08)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.3)
    return model.eval()


def deepseek_checkpoint(config: Any, folder: Path) -> Any:
    """Saves a random model of `config` in `folder`; returns it."""
    model = random_deepseek(config)
    model.save_pretrained(folder)
    return model
