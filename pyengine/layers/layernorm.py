"""RMSNorm over the fused CPU/CUDA kernels."""

from __future__ import annotations

import torch
from torch import nn

from pyengine import ops


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


def stream_sum(residual: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """residual + h, the residual stream's last sum: on the CPU by a kernel (so that a
    recorded decode step holds it), elsewhere by torch."""
    if not residual.is_cpu:
        return residual + h
    out = torch.empty_like(h)
    ops.add(out, residual, h)
    return out
