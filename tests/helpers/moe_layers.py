"""Random FusedMoE layers and the tokens to check them with, against the float64
reference of their routed and shared experts (tests/layers/test_fused_moe.py on the CPU,
tests/kernels/test_moe_cuda.py on CUDA)."""

from __future__ import annotations

from typing import Any

import torch

from pyengine.layers.moe.activation import SILU, ExpertActivation
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


def random_layer(
    routing: RoutingConfig, dtype: torch.dtype, shared: str, device: str = "cpu",
    **options: Any,
) -> tuple[FusedMoE, dict[str, torch.Tensor]]:  # fmt: skip
    """A layer of random weights (rounded to `dtype`) on `device`, and those weights in
    float32 on the CPU; shared: "" (none), "gated" or "ungated"; `options`: FusedMoE's
    (activation, expert_bias, router_bias)."""
    placement = Placement(dtype=dtype, device=torch.device(device))
    layer = FusedMoE(
        HIDDEN, N, routing, placement, SHARED_N if shared else 0, shared == "gated", **options
    )
    weights = {}
    for name, p in layer.named_parameters():
        w = (torch.randn(p.shape) / p.shape[-1] ** 0.5).to(dtype)
        p.data.copy_(w)
        weights[name] = w.float()
    layer.process_weights_after_loading()
    return layer, weights


def unambiguous_tokens(
    count: int, router: torch.Tensor, config: RoutingConfig, dtype: torch.dtype,
    router_bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """`count` random tokens in `dtype` whose experts no rounding of their logits changes:
    a near tie at the top k would otherwise compare different experts' sums."""
    kept: list[torch.Tensor] = []
    while len(kept) < count:
        x = torch.randn(HIDDEN).to(dtype)
        logits = x.double() @ router.double().T
        if router_bias is not None:
            logits = logits + router_bias.double()
        chosen = route(logits[None], config).expert_ids
        trials = logits + ROUNDING[dtype] * torch.randn(16, config.num_experts, dtype=torch.float64)
        if all(torch.equal(route(t[None], config).expert_ids, chosen) for t in trials):
            kept.append(x)
    return torch.stack(kept)


def reference_output(
    x: torch.Tensor, w: dict[str, torch.Tensor], config: RoutingConfig,
    activation: ExpertActivation = SILU,
) -> torch.Tensor:  # fmt: skip
    """The layer of weights `w` (random_layer's) on tokens x, in float64 on the CPU."""
    xf = x.float().cpu()
    logits = xf @ w["router"].T
    if "router_bias" in w:
        logits = logits + w["router_bias"]
    chosen = route(logits, config)
    want = routed_experts_reference(xf, w["gate_up"], w["down"], chosen, activation,
                                    w.get("gate_up_bias"), w.get("down_bias"))  # fmt: skip
    if "shared_expert.gate_up" in w:
        gate = w.get("shared_expert.gate")
        want += shared_expert_reference(
            xf, w["shared_expert.gate_up"], w["shared_expert.down"], gate
        )
    return want
