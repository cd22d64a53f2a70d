"""Mamba-2's mixer (pyengine/layers/mamba2_mixer.py) against transformers' Mamba2Mixer and
the Mamba layers of Bamba, Granite 4 (GraniteMoeHybrid), Nemotron-H and Falcon-H1 (its
multipliers, its norm before or after the gate, or none) on the same random weights: a
whole prompt longer than transformers' own chunks, and the same prompt in pieces through
the state slots (a chunked prefill, then decode steps), float32, with groups of heads
sharing B and C and a clamp of the step."""

from __future__ import annotations

import pytest
import torch

from pyengine.layers.mamba2_mixer import Mamba2Mixer, Mamba2Shape
from pyengine.layers.recurrent_state import RecurrentStates

transformers = pytest.importorskip("transformers")


SIZES = dict(heads=6, head_dim=8, groups=2, state=12, conv=4, chunk=16)


def random_layer(family: str, limit: tuple[float, float]):  # type: ignore[no-untyped-def]
    """transformers' Mamba-2 mixer of `family` (Mamba2 or a hybrid built on it), every
    parameter random."""
    import importlib

    z = SIZES
    mamba = dict(mamba_n_heads=z["heads"], mamba_d_head=z["head_dim"], mamba_expand=2,
                 mamba_n_groups=z["groups"], mamba_d_state=z["state"], mamba_d_conv=z["conv"],
                 mamba_chunk_size=z["chunk"], mamba_conv_bias=True)  # fmt: skip
    configs = {
        "mamba2": ("Mamba2Mixer", transformers.Mamba2Config, dict(
            num_heads=z["heads"], head_dim=z["head_dim"], expand=2, n_groups=z["groups"],
            state_size=z["state"], conv_kernel=z["conv"], chunk_size=z["chunk"],
            use_conv_bias=True, time_step_limit=limit)),
        "bamba": ("BambaMixer", transformers.BambaConfig, mamba),
        "granitemoehybrid": ("GraniteMoeHybridMambaLayer", transformers.GraniteMoeHybridConfig,
                             dict(mamba, layer_types=["mamba"])),
        "nemotron_h": ("NemotronHMamba2Mixer", transformers.NemotronHConfig, dict(
            mamba_num_heads=z["heads"], mamba_head_dim=z["head_dim"], expand=2,
            n_groups=z["groups"], ssm_state_size=z["state"], conv_kernel=z["conv"],
            chunk_size=z["chunk"], use_conv_bias=True)),
    }  # fmt: skip
    falcon = dict(mamba, mamba_d_ssm=2 * 24, num_attention_heads=2, num_key_value_heads=2,
                  ssm_multipliers=[0.5, 1.3, 0.8, 1.1, 0.7], ssm_in_multiplier=1.2)  # fmt: skip
    configs |= {
        "falcon_h1": ("FalconH1Mixer", transformers.FalconH1Config,
                      dict(falcon, mamba_rms_norm=False)),
        "falcon_h1-norm-first": ("FalconH1Mixer", transformers.FalconH1Config,
                                 dict(falcon, mamba_rms_norm=True, mamba_norm_before_gate=True)),
        "falcon_h1-gate-first": ("FalconH1Mixer", transformers.FalconH1Config,
                                 dict(falcon, mamba_rms_norm=True, mamba_norm_before_gate=False)),
    }  # fmt: skip
    name, config_class, fields = configs[family]
    family = family.split("-")[0]
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config = config_class(hidden_size=24, num_hidden_layers=1, **fields)
    torch.manual_seed(0)
    layer = getattr(module, name)(config, 0).eval()
    if family == "falcon_h1":  # (the model's: its multipliers of the projection's outputs)
        layer.register_buffer("mup_vector", module.compute_mup_vector(config))
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
    falcon = hasattr(layer, "mup_vector")
    norm = "after_gate"
    if falcon:
        norm = "none" if not layer.mamba_rms_norm else (
            "before_gate" if layer.norm.norm_before_gate else "after_gate")  # fmt: skip
    has_norm = norm != "none"
    shape = Mamba2Shape(layer.num_heads, layer.head_dim, layer.n_groups, layer.ssm_state_size,
                        layer.conv_kernel_size,
                        layer.norm.variance_epsilon if has_norm else 1e-6,
                        *layer.time_step_limit, norm=norm)  # fmt: skip
    mixer = Mamba2Mixer(shape, layer.conv1d.weight.detach()[:, 0], layer.conv1d.bias.detach(),
                        layer.A_log.detach(), layer.D.detach(), layer.dt_bias.detach(),
                        layer.norm.weight.detach() if has_norm else torch.ones(shape.inner),
                        )  # fmt: skip

    def project(rows: torch.Tensor) -> torch.Tensor:
        if not falcon:
            return layer.in_proj(rows)
        # (Falcon-H1's multipliers, which its model folds into the projection)
        return layer.in_proj(rows * layer.ssm_in_multiplier) * layer.mup_vector[0, 0]

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
            outs.append(layer.out_proj(mixer(project(x[start : start + n]), states)))
            start += n
    return torch.cat(outs)


@pytest.mark.parametrize(
    ("family", "limit"),
    [("mamba2", (0.0, float("inf"))), ("mamba2", (0.1, 1.5)), ("bamba", (0.0, float("inf"))),
     ("granitemoehybrid", (0.0, float("inf"))), ("nemotron_h", (0.0, float("inf"))),
     ("falcon_h1", (0.0, float("inf"))), ("falcon_h1-norm-first", (0.0, float("inf"))),
     ("falcon_h1-gate-first", (0.0, float("inf")))],
    ids=["mamba2", "mamba2-clamped", "bamba", "granite4", "nemotron_h", "falcon_h1",
         "falcon_h1-norm-first", "falcon_h1-gate-first"],
)  # fmt: skip
@pytest.mark.parametrize("pieces", [[40], [17, 1, 21, 1]], ids=["whole", "pieces"])
def test_matches_transformers_mixer(
    family: str, limit: tuple[float, float], pieces: list[int]
) -> None:
    layer = random_layer(family, limit)
    x = torch.randn(sum(pieces), 24)
    with torch.no_grad():
        want = layer(x[None])[0]
    got = run_pieces(layer, x, pieces)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
