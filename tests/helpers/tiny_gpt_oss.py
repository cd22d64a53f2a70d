"""Tiny random gpt-oss models that transformers makes: attention with biases, 16-token
windows on alternating layers, experts with biases and the clamped SwiGLU at a limit the
random products pass, learned sinks drawn large enough to matter, random norms."""

from __future__ import annotations

from typing import Any

import torch

SHAPE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8,
    num_experts_per_tok=2, sliding_window=16, max_position_embeddings=256, swiglu_limit=0.6,
)  # fmt: skip


def random_gpt_oss(**overrides: Any) -> Any:
    """A model of SHAPE (with `overrides`), float32, every parameter random (seed 0)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GptOssConfig(**{**SHAPE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm, sinks = "norm" in name, name.endswith("sinks")
            p.normal_(1.0 if norm else 0.0, 1.0 if sinks else 0.1 if norm else 0.08)
    return model.eval()
