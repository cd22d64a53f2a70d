"""What an expert does between its two products, as each model family defines it: a
registry entry (EXPERT_ACTIVATIONS), chosen by the checkpoint's config.

- "silu": silu(gate) * up (Mixtral, Qwen2/3-MoE, DeepSeek, Llama 4, OLMoE).
- "clamped_swiglu": gpt-oss's: g = min(gate, limit), u = clamp(up, -limit, limit),
  g * sigmoid(alpha * g) * (u + 1); its experts also have biases on both products.

The CPU kernel (ops.fused_experts) computes both; these functions are their definition
(the float64 reference uses them) and the torch path elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ExpertActivation:
    kind: str = "silu"
    alpha: float = 1.702  # clamped_swiglu's
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in EXPERT_ACTIVATIONS:
            raise ValueError(
                f"expert activation {self.kind!r} is not one of {', '.join(EXPERT_ACTIVATIONS)}"
            )

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return EXPERT_ACTIVATIONS[self.kind](gate, up, self)

    @property
    def fuses_with_silu(self) -> bool:
        """Whether it is silu(gate) * up, which the panel kernels fuse into the product."""
        return self.kind == "silu"


def _silu(gate: torch.Tensor, up: torch.Tensor, a: ExpertActivation) -> torch.Tensor:
    return F.silu(gate) * up


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, a: ExpertActivation) -> torch.Tensor:
    g = gate.clamp(max=a.limit)
    return g * torch.sigmoid(g * a.alpha) * (up.clamp(-a.limit, a.limit) + 1)


EXPERT_ACTIVATIONS: dict[
    str, Callable[[torch.Tensor, torch.Tensor, ExpertActivation], torch.Tensor]
]
EXPERT_ACTIVATIONS = {"silu": _silu, "clamped_swiglu": _clamped_swiglu}
SILU = ExpertActivation()


def expert_activation(hf: Any) -> ExpertActivation:
    """The activation a Hugging Face config's experts take (gpt-oss's clamped SwiGLU, by
    its swiglu_alpha and swiglu_limit; silu otherwise)."""
    if str(getattr(hf, "model_type", "")) == "gpt_oss":
        alpha, limit = getattr(hf, "swiglu_alpha", 1.702), getattr(hf, "swiglu_limit", 7.0)
        return ExpertActivation("clamped_swiglu", float(alpha), float(limit))
    return SILU
