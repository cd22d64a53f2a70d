"""The FusedMoE layer through each of its methods (packed panels and the fused kernels
on the CPU in float32 and bfloat16; torch expert by expert in float16) against the
float64 reference of its routed experts and shared expert, for every routing variant,
with and without a shared expert and its gate; and what each method holds."""

from __future__ import annotations

import pytest
import torch

from pyengine.layers.moe.layer import FusedMoE
from pyengine.layers.moe.reference import routed_experts_reference, shared_expert_reference
from pyengine.layers.moe.routing import RoutingConfig, route
from pyengine.layers.placement import Placement

HIDDEN, N, SHARED_N = 64, 48, 80
ROUTINGS = {
    "softmax": RoutingConfig("softmax", 2, 6, renormalize=False),
    "grouped_sigmoid": RoutingConfig(
        "grouped_sigmoid", 2, 8, renormalize=True, num_groups=4, topk_groups=2
    ),
    "sigmoid_on_input": RoutingConfig("sigmoid_on_input", 1, 4),
}
# The largest error against float64 relative to the result's largest magnitude, by dtype.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 4e-2, torch.float16: 4e-3}
# How far the layer's router logits may stray from float64's by rounding (bfloat16's
# 8 bits, float16's 11, float32's 24, on logits of about 1): the tokens are drawn so that
# no such change would route them otherwise.
ROUNDING = {torch.float32: 1e-5, torch.bfloat16: 0.05, torch.float16: 5e-3}
FORMS = {
    torch.float32: "float32 expert panels",
    torch.bfloat16: "bfloat16 expert panels",
    torch.float16: None,
}


def random_layer(
    routing: RoutingConfig, dtype: torch.dtype, shared: str
) -> tuple[FusedMoE, dict[str, torch.Tensor]]:
    """A layer of random weights (rounded to `dtype`), and those weights in float32."""
    layer = FusedMoE(
        HIDDEN, N, routing, Placement(dtype=dtype), SHARED_N if shared else 0, shared == "gated"
    )
    weights = {}
    for name, p in layer.named_parameters():
        w = (torch.randn(p.shape) / p.shape[-1] ** 0.5).to(dtype)
        p.data.copy_(w)
        weights[name] = w.float()
    layer.process_weights_after_loading()
    return layer, weights


def unambiguous_tokens(
    count: int, router: torch.Tensor, config: RoutingConfig, dtype: torch.dtype
) -> torch.Tensor:
    """`count` random tokens in `dtype` whose experts no rounding of their logits changes:
    a near tie at the top k would otherwise compare different experts' sums."""
    kept: list[torch.Tensor] = []
    while len(kept) < count:
        x = torch.randn(HIDDEN).to(dtype)
        logits = x.double() @ router.double().T
        chosen = route(logits[None], config).expert_ids
        trials = logits + ROUNDING[dtype] * torch.randn(16, config.num_experts, dtype=torch.float64)
        if all(torch.equal(route(t[None], config).expert_ids, chosen) for t in trials):
            kept.append(x)
    return torch.stack(kept)


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shared", ["", "gated", "ungated"])
def test_the_layer_is_its_routed_and_shared_experts(
    routing: str, dtype: torch.dtype, shared: str
) -> None:
    config = ROUTINGS[routing]
    layer, w = random_layer(config, dtype, shared)
    x = unambiguous_tokens(9, w["router"], config, dtype)
    xf = x.float()
    chosen = route(xf @ w["router"].T, config)
    want = routed_experts_reference(xf, w["gate_up"], w["down"], chosen)
    if shared:
        gate = w.get("shared_expert.gate")
        want += shared_expert_reference(
            xf, w["shared_expert.gate_up"], w["shared_expert.down"], gate
        )
    got = layer(x)
    assert got.dtype == dtype and got.shape == x.shape
    assert (got.double() - want).abs().max().item() <= TOLERANCE[dtype] * want.abs().max().item()
    assert layer.weight_form() == FORMS[dtype]
    held = layer.held_tensors()
    if FORMS[dtype] is None:
        assert held == [] and layer.gate_up.dtype == dtype  # (its parameters multiply)
    else:  # the packed forms alone: router, experts, and the shared expert's
        assert len(held) == 3 + (2 if shared else 0) + (shared == "gated")
        assert not hasattr(layer, "gate_up")
