"""RMSNorm over the fused CPU/CUDA kernels."""

from __future__ import annotations

import torch
from torch import nn

from pyengine import ops
from pyengine.distributed import TensorParallelGroup


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Per head (Qwen3's q/k norms: [tokens, heads, head_size]) by the kernel on the CPU,
        # so that a recorded decode step holds them.
        if x.dim() == 2 or (x.dim() == 3 and x.is_cpu):
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            ops.rms_norm(out, x, self.weight, self.eps)
            return out
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))

    def add_residual(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        """In place: residual += x; x = norm(residual)."""
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class ProjectionRMSNorm(RMSNorm):
    """An RMSNorm over a whole projection, every head at once (OLMoE's q and k norms), of
    which this rank holds features [start, start + size) of `whole`: under tensor
    parallelism each rank's sum of squares is all-reduced (each feature counted once:
    `replicas` ranks hold each, as kv heads replicated over more ranks than there are)."""

    def __init__(
        self, size: int, whole: int, start: int, eps: float, tp: TensorParallelGroup,
        replicas: int = 1,
    ) -> None:  # fmt: skip
        super().__init__(size, eps)
        self.whole, self.start, self.tp, self.replicas = whole, start, tp, replicas

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(x)
        squares = self.tp.all_reduce(x.float().pow(2).sum(-1, keepdim=True)) / self.replicas
        normed = x.float() * torch.rsqrt(squares / self.whole + self.eps)
        return (self.weight.float() * normed).to(x.dtype)


def stream_sum(residual: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """residual + h, the residual stream's last sum: on the CPU by a kernel (so that a
    recorded decode step holds it), elsewhere by torch."""
    if not residual.is_cpu:
        return residual + h
    out = torch.empty_like(h)
    ops.add(out, residual, h)
    return out
