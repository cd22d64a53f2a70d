"""Mamba-2's token mixer (Mamba2, and the hybrids built on it: Falcon-H1, Granite 4,
Nemotron-H, Bamba): the layer between its input projection and its output projection,
over each request's recurrent state.

The input projection gives, per token, a gate [H * P], then x, B and C [H * P + 2 G N]
(through a short causal convolution with its bias and SiLU, whose last inputs a request
keeps), then dt [H]. The state-space recurrence (`ops.ssm_scan`: the step softplus(dt +
dt_bias) clamped to the layer's limits, decay exp(step A) with A = -exp(A_log), input
along B, read along C, skip D) runs over each request's state [H, P, N]; its output,
gated by SiLU(gate), is RMS-normalised per group of H * P / G numbers (or normalised
first, or only gated: Falcon-H1's options). Falcon-H1's multipliers of the input and of
the projection's outputs are its model's, folded into the projection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from pyengine import ops
from pyengine.layers.recurrent_state import RecurrentStates


@dataclass(frozen=True)
class Mamba2Shape:
    """A layer's sizes (per tensor-parallel rank: heads and groups split)."""

    heads: int
    head_dim: int
    groups: int
    state_size: int
    conv_width: int
    eps: float = 1e-5
    dt_min: float = 0.0
    dt_max: float = float("inf")
    # The gated RMSNorm's order: the gate first (Mamba-2's), the norm first (Falcon-H1's
    # mamba_norm_before_gate), or the gate alone (Falcon-H1 without mamba_rms_norm).
    norm: Literal["after_gate", "before_gate", "none"] = "after_gate"

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return self.inner + 2 * self.groups * self.state_size


class Mamba2Mixer:
    """One layer's parameters: conv_weight [conv_channels, conv_width], conv_bias
    [conv_channels] or None, A_log, D and dt_bias [H], norm_weight [H * P]."""

    def __init__(
        self,
        shape: Mamba2Shape,
        conv_weight: torch.Tensor,
        conv_bias: torch.Tensor | None,
        a_log: torch.Tensor,
        d: torch.Tensor,
        dt_bias: torch.Tensor,
        norm_weight: torch.Tensor,
    ) -> None:
        self.shape = shape
        self.conv_weight = conv_weight.float().contiguous()
        self.conv_bias = conv_bias.float().contiguous() if conv_bias is not None else None
        self.a = -a_log.float().exp()  # (A = -exp(A_log), once)
        self.d = d.float().contiguous()
        self.dt_bias = dt_bias.float().contiguous()
        self.norm_weight = norm_weight.float()

    def __call__(self, projected: torch.Tensor, states: RecurrentStates) -> torch.Tensor:
        """projected [T, H * P + conv_channels + H] (the input projection's output): the
        layer's outputs before its output projection, [T, H * P] float32."""
        s = self.shape
        tokens = projected.shape[0]
        gate, xbc, dt = torch.split(projected.float(), [s.inner, s.conv_channels, s.heads], -1)
        mixed = torch.empty(tokens, s.conv_channels)
        ops.causal_conv1d(mixed, xbc.contiguous(), self.conv_weight, self.conv_bias, states.conv,
                          states.slots, states.has_state, states.query_start_loc, True)  # fmt: skip
        groups_size = s.groups * s.state_size
        x, b, c = torch.split(mixed, [s.inner, groups_size, groups_size], dim=-1)
        out = torch.empty(tokens, s.heads, s.head_dim)
        ops.ssm_scan(
            out,
            x.reshape(tokens, s.heads, s.head_dim).contiguous(),
            dt.contiguous(),
            self.a,
            b.reshape(tokens, s.groups, s.state_size).contiguous(),
            c.reshape(tokens, s.groups, s.state_size).contiguous(),
            self.d,
            self.dt_bias,
            states.recurrent,
            states.slots,
            states.has_state,
            states.query_start_loc,
            True,
            s.dt_min,
            s.dt_max,
        )
        # Gated, and RMS-normalised per group, in the layer's order.
        y = out.reshape(tokens, s.inner)
        gate = F.silu(gate)
        if s.norm == "none":
            return y * gate
        if s.norm == "after_gate":
            y = y * gate
        grouped = y.reshape(tokens, s.groups, -1)
        normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + s.eps)
        y = normed.reshape(tokens, s.inner) * self.norm_weight
        return y * gate if s.norm == "before_gate" else y
