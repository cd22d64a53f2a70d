"""Mamba-2's mixer (pyengine/layers/mamba2_mixer.py) against transformers' Mamba2Mixer on
the same random weights: a whole prompt longer than transformers' own chunks, and the
same prompt in pieces through the state slots (a chunked prefill, then decode steps),
float32, with groups of heads sharing B and C and a clamp of the step."""

from __future__ import annotations

import pytest
import torch

from pyengine.layers.mamba2_mixer import Mamba2Mixer, Mamba2Shape
from pyengine.layers.recurrent_state import RecurrentStates

transformers = pytest.importorskip("transformers")


def mamba2_layer(limit: tuple[float, float]):  # type: ignore[no-untyped-def]
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMixer

    config = transformers.Mamba2Config(
        hidden_size=24, num_heads=6, head_dim=8, expand=2, n_groups=2, state_size=12,
        conv_kernel=4, chunk_size=16, num_hidden_layers=1, use_conv_bias=True,
        time_step_limit=limit, layer_norm_epsilon=1e-5,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = HFMixer(config, 0).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.rand_like(p).mul(2).add(0.2).log())
            elif name in ("D", "norm.weight"):
                p.normal_(1.0, 0.3)
            else:
                p.normal_(0.0, 0.2)
    return layer


def run_pieces(layer, x: torch.Tensor, pieces: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """x [T, hidden] through our mixer in `pieces`, one request in slot 2 of 3."""
    shape = Mamba2Shape(layer.num_heads, layer.head_dim, layer.n_groups, layer.ssm_state_size,
                        layer.conv_kernel_size, layer.layer_norm_epsilon,
                        *layer.time_step_limit)  # fmt: skip
    mixer = Mamba2Mixer(shape, layer.conv1d.weight.detach()[:, 0], layer.conv1d.bias.detach(),
                        layer.A_log.detach(), layer.D.detach(), layer.dt_bias.detach(),
                        layer.norm.weight.detach())  # fmt: skip
    conv = torch.full((3, shape.conv_channels, shape.conv_width - 1), float("nan"))
    ssm = torch.full((3, shape.heads, shape.head_dim, shape.state_size), float("nan"))
    outs, start = [], 0
    with torch.no_grad():
        for i, n in enumerate(pieces):
            states = RecurrentStates(
                conv, ssm, torch.tensor([2], dtype=torch.int32),
                torch.tensor([int(i > 0)], dtype=torch.int32),
                torch.tensor([0, n], dtype=torch.int32),
            )  # fmt: skip
            outs.append(layer.out_proj(mixer(layer.in_proj(x[start : start + n]), states)))
            start += n
    return torch.cat(outs)


@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.1, 1.5)], ids=["free", "clamped"])
@pytest.mark.parametrize("pieces", [[40], [17, 1, 21, 1]], ids=["whole", "pieces"])
def test_matches_transformers_mamba2_mixer(pieces: list[int], limit: tuple[float, float]) -> None:
    layer = mamba2_layer(limit)
    x = torch.randn(sum(pieces), 24)
    with torch.no_grad():
        want = layer(x[None])[0]
    got = run_pieces(layer, x, pieces)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
