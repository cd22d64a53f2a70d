"""A mixture-of-experts layer's shared expert: the expert every token takes beside its
routed ones (Qwen2-MoE's, scaled by a sigmoid gate; DeepSeek's and Llama 4's, ungated).
Over tensor-parallel ranks each rank holds a slice of its intermediate size, with or
without expert parallelism. Its weights are float parameters (SharedExpert) or, in a
quantized checkpoint, linear layers of the checkpoint's method (linear_experts.py)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pyengine.models.weights import WeightRouter


class SharedBase(nn.Module):
    """What every form of the shared expert has: its gate [1, hidden] where it has one
    (its output scaled by sigmoid(x . gate)), and this rank's rows [start, start + n) of
    its `whole` intermediate size."""

    def __init__(self, gate: nn.Parameter | None, start: int, size: int, whole: int) -> None:
        super().__init__()
        self.gate = gate
        self.start, self.intermediate_size, self.whole = start, size, whole or size

    @abstractmethod
    def route(self, router: WeightRouter, modules: Sequence[str]) -> None:
        """Routes the checkpoint modules of its gate, up and down projections to it."""

    def scaled(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Its output y for rows x, scaled by its gate where it has one."""
        return y if self.gate is None else torch.sigmoid(F.linear(x, self.gate)) * y


class SharedExpert(SharedBase):
    """Float weights: gate_up [2 n, hidden] (the gate's rows first), down [hidden, n]."""

    def __init__(
        self,
        gate_up: nn.Parameter,
        down: nn.Parameter,
        gate: nn.Parameter | None,
        start: int = 0,
        whole: int = 0,
    ) -> None:
        super().__init__(gate, start, down.shape[1], whole)
        self.gate_up, self.down = gate_up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return self.scaled(x, F.linear(F.silu(gate) * up, self.down))

    def route(self, router: WeightRouter, modules: Sequence[str]) -> None:
        n = self.intermediate_size
        parts = ((self.gate_up[:n], 0), (self.gate_up[n:], 0), (self.down, 1))
        for module, (into, dim) in zip(modules, parts, strict=True):
            router.shard(f"{module}.weight", into, dim, self.start, self.whole)
