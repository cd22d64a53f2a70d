"""Gated DeltaNet's mixer (pyengine/layers/gated_delta_net.py) against transformers'
Qwen3-Next and Qwen3.5 layers on the same random weights: a whole prompt longer than
transformers' own chunks of 64, and the same prompt in pieces through the state slots (a
chunked prefill, then decode steps), float32."""

from __future__ import annotations

import pytest
import torch

from pyengine.layers.gated_delta_net import (
    DeltaNetShape,
    GatedDeltaNetMixer,
    split_qwen3_5,
    split_qwen3_next,
)
from pyengine.layers.recurrent_state import RecurrentStates

transformers = pytest.importorskip("transformers")


SHAPE = dict(
    hidden_size=48, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1,
    layer_types=["linear_attention"], rms_norm_eps=1e-6,
)  # fmt: skip


def random_layer(family: str):  # type: ignore[no-untyped-def]
    """transformers' Gated DeltaNet layer of `family` ("qwen3_next" or "qwen3_5"), every
    parameter random."""
    if family == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        layer = Qwen3NextGatedDeltaNet(transformers.Qwen3NextConfig(**SHAPE), 0)
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        layer = Qwen3_5GatedDeltaNet(transformers.Qwen3_5TextConfig(**SHAPE), 0)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.rand_like(p).mul(3).add(0.5).log())
            elif name in ("dt_bias", "norm.weight"):
                p.normal_(1.0 if name == "norm.weight" else 0.0, 0.3)
            else:
                p.normal_(0.0, 0.2)
    return layer.eval()


def projected(layer, rows: torch.Tensor, shape: DeltaNetShape):  # type: ignore[no-untyped-def]
    """The layer's projections of `rows`, as our mixer's inputs."""
    if hasattr(layer, "in_proj_qkvz"):
        return split_qwen3_next(layer.in_proj_qkvz(rows), layer.in_proj_ba(rows), shape)
    return split_qwen3_5(layer.in_proj_qkv(rows), layer.in_proj_z(rows), layer.in_proj_b(rows),
                         layer.in_proj_a(rows), shape)  # fmt: skip


def ours(layer):  # type: ignore[no-untyped-def]
    shape = DeltaNetShape(
        layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim,
        layer.conv_kernel_size, layer.layer_norm_epsilon,
    )  # fmt: skip
    mixer = GatedDeltaNetMixer(shape, layer.conv1d.weight.detach()[:, 0], layer.A_log.detach(),
                               layer.dt_bias.detach(), layer.norm.weight.detach())  # fmt: skip
    return shape, mixer


def run_pieces(layer, x: torch.Tensor, pieces: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """x [T, hidden] through our mixer in `pieces`, one request in slot 1 of 3."""
    shape, mixer = ours(layer)
    conv = torch.full((3, shape.conv_channels, shape.conv_width - 1), float("nan"))
    recurrent = torch.full((3, shape.value_heads, shape.key_dim, shape.value_dim), float("nan"))
    outs, start = [], 0
    with torch.no_grad():
        for i, n in enumerate(pieces):
            rows = x[start : start + n]
            inputs = projected(layer, rows, shape)
            states = RecurrentStates(
                conv, recurrent, torch.tensor([1], dtype=torch.int32),
                torch.tensor([int(i > 0)], dtype=torch.int32),
                torch.tensor([0, n], dtype=torch.int32),
            )  # fmt: skip
            outs.append(layer.out_proj(mixer(inputs, states)))
            start += n
    return torch.cat(outs)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("pieces", [[70], [30, 1, 38, 1]], ids=["whole", "pieces"])
def test_matches_transformers_layer(family: str, pieces: list[int]) -> None:
    layer = random_layer(family)
    x = torch.randn(sum(pieces), 48)
    with torch.no_grad():
        want = layer(x[None])[0]
    got = run_pieces(layer, x, pieces)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
