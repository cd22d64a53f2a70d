"""Gated DeltaNet's token mixer (Qwen3-Next, Qwen3.5): the layer between its input
projections and its output projection, over each request's recurrent state.

The projections give, per token, the query, key and value (through a short causal
convolution with SiLU, whose last inputs a request keeps), a gate z per value head's
outputs, and per value head b (the update's strength, beta = sigmoid(b)) and a (the
decay, g = -exp(A_log) * softplus(a + dt_bias)). The gated delta rule then runs over
each request's state [Hv, dk, dv], q and k L2-normalised and q scaled by 1/sqrt(dk), and
its outputs are RMS-normalised per head and gated by SiLU(z). Each model lays its
projections out its own way (`split_qwen3_next` for Qwen3-Next's interleaved one,
`split_qwen3_5` for Qwen3.5's four).

The states live in slots the caller names per request (`RecurrentStates`); a request
whose slot is new reads it as zeros (`has_state` 0), so that a step may mix prefills,
chunks of prefills and decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pyengine import ops
from pyengine.layers.recurrent_state import RecurrentStates


@dataclass(frozen=True)
class DeltaNetShape:
    """A layer's sizes (per tensor-parallel rank: heads split)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_width: int
    eps: float = 1e-6

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass(frozen=True)
class DeltaNetInputs:
    """What the projections give, per token: qkv [T, conv_channels] (queries, keys, then
    values, before the convolution), z [T, Hv, dv], b and a [T, Hv]."""

    qkv: torch.Tensor
    z: torch.Tensor
    b: torch.Tensor
    a: torch.Tensor


def split_qwen3_next(qkvz: torch.Tensor, ba: torch.Tensor, shape: DeltaNetShape) -> DeltaNetInputs:
    """Qwen3-Next's in_proj_qkvz and in_proj_ba outputs, which interleave by key head
    (each key head's query, key, then its value heads' values and gates; its value
    heads' b, then a), as DeltaNetInputs."""
    tokens, hk = qkvz.shape[0], shape.key_heads
    per = shape.value_heads // hk
    dk, dv = shape.key_dim, shape.value_dim
    q, k, v, z = torch.split(qkvz.view(tokens, hk, -1), [dk, dk, per * dv, per * dv], dim=-1)
    b, a = split_ba(ba, shape)
    qkv = torch.cat((q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)), -1)
    return DeltaNetInputs(qkv.contiguous(), z.reshape(tokens, shape.value_heads, dv), b, a)


def split_ba(ba: torch.Tensor, shape: DeltaNetShape) -> tuple[torch.Tensor, torch.Tensor]:
    """b and a [tokens, value heads] from Qwen3-Next's in_proj_ba output, which holds
    each key head's value heads' b, then their a."""
    tokens, per = ba.shape[0], shape.value_heads // shape.key_heads
    b, a = torch.split(ba.view(tokens, shape.key_heads, 2 * per), [per, per], dim=-1)
    return b.reshape(tokens, shape.value_heads), a.reshape(tokens, shape.value_heads)


def split_qwen3_5(
    qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, shape: DeltaNetShape
) -> DeltaNetInputs:
    """Qwen3.5's four projections (in_proj_qkv: queries, keys, then values, as the
    convolution takes them; in_proj_z, in_proj_b, in_proj_a) as DeltaNetInputs."""
    return DeltaNetInputs(qkv.contiguous(), z.reshape(z.shape[0], shape.value_heads, -1), b, a)


class GatedDeltaNetMixer:
    """One layer's parameters: conv_weight [conv_channels, conv_width], A_log and dt_bias
    [Hv], norm_weight [dv] (float32 on the CPU)."""

    def __init__(
        self,
        shape: DeltaNetShape,
        conv_weight: torch.Tensor,
        a_log: torch.Tensor,
        dt_bias: torch.Tensor,
        norm_weight: torch.Tensor,
    ) -> None:
        self.shape = shape
        self.conv_weight = conv_weight.float().contiguous()
        self.decay_rate = -a_log.float().exp()  # (-exp(A_log), once)
        self.dt_bias = dt_bias.float()
        self.norm_weight = norm_weight.float()

    def __call__(self, inputs: DeltaNetInputs, states: RecurrentStates) -> torch.Tensor:
        """The layer's outputs before its output projection: [T, Hv * dv], float32."""
        s = self.shape
        tokens = inputs.qkv.shape[0]
        mixed = torch.empty(tokens, s.conv_channels)
        ops.causal_conv1d(mixed, inputs.qkv.float(), self.conv_weight, None, states.conv,
                          states.slots, states.has_state, states.query_start_loc, True)  # fmt: skip
        key_size = s.key_heads * s.key_dim
        q, k, v = torch.split(mixed, [key_size, key_size, s.value_heads * s.value_dim], dim=-1)
        beta = torch.sigmoid(inputs.b.float())
        g = self.decay_rate * F.softplus(inputs.a.float() + self.dt_bias)
        out = torch.empty(tokens, s.value_heads, s.value_dim)
        ops.gated_delta_rule(
            out,
            q.reshape(tokens, s.key_heads, s.key_dim).contiguous(),
            k.reshape(tokens, s.key_heads, s.key_dim).contiguous(),
            v.reshape(tokens, s.value_heads, s.value_dim).contiguous(),
            g.contiguous(),
            beta.contiguous(),
            states.recurrent,
            states.slots,
            states.has_state,
            states.query_start_loc,
            s.key_dim**-0.5,
            True,
        )
        # RMS-normalised per head, then gated (the norm before the gate, as Qwen3-Next's).
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + s.eps) * self.norm_weight
        gated = normed * F.silu(inputs.z.float())
        return gated.reshape(tokens, s.value_heads * s.value_dim)
