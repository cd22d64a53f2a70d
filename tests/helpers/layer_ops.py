"""The layer-op tests' float64 torch references and tolerances, shared by the CPU and the
CUDA kernel tests."""

from __future__ import annotations

import torch

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


DTYPES = list(TOLERANCE)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, on the CPU whatever device either is on."""
    got, want = got.double().cpu(), want.cpu()
    return ((got - want).abs().max() / want.abs().max()).item()


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 rms_norm of x's rows times weight."""
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def rotary_reference(
    x: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    """float64 rotary embedding of x [tokens, heads, d] by angles freqs[positions]."""
    angles = freqs.to(x.device)[positions][:, None]  # [tokens, 1, d/2]
    c, s = angles.cos(), angles.sin()
    half = x.shape[-1] // 2
    if is_neox:
        a, b = x[..., :half], x[..., half:]
        return torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
