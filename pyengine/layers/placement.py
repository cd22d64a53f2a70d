"""Where a model runs and in which dtype."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Placement:
    """Float32 on the CPU runs pyengine's own matmul over packed weights; anything else
    runs torch's (cuBLAS on CUDA)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32

    @property
    def packs_weights(self) -> bool:
        return self.device.type == "cpu" and self.dtype == torch.float32
