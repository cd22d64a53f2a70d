"""The FusedMoE layer through each of its methods (packed panels and the fused kernels
on the CPU in float32 and bfloat16; torch expert by expert in float16) against the
float64 reference of its routed experts and shared expert, for every routing variant,
with and without a shared expert and its gate; and what each method holds."""

from __future__ import annotations

import pytest
import torch
from helpers.moe_layers import (
    ROUTINGS,
    TOLERANCE,
    random_layer,
    reference_output,
    unambiguous_tokens,
)

from pyengine.layers.moe.activation import ExpertActivation
from pyengine.layers.moe.routing import RoutingConfig

FORMS = {
    torch.float32: "float32 expert panels",
    torch.bfloat16: "bfloat16 expert panels",
    torch.float16: None,
}


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shared", ["", "gated", "ungated"])
def test_the_layer_is_its_routed_and_shared_experts(
    routing: str, dtype: torch.dtype, shared: str
) -> None:
    config = ROUTINGS[routing]
    layer, w = random_layer(config, dtype, shared)
    x = unambiguous_tokens(9, w["router"], config, dtype)
    want = reference_output(x, w, config)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpt_oss_experts_their_biases_and_clamped_swiglu(dtype: torch.dtype) -> None:
    """A router with a bias, experts with biases on both products, and the clamped SwiGLU
    (at a limit the products pass, so that the clamp bites), through each method."""
    config = RoutingConfig("softmax", 2, 6, renormalize=True)
    activation = ExpertActivation("clamped_swiglu", alpha=1.702, limit=0.5)
    layer, w = random_layer(config, dtype, "", activation=activation, expert_bias=True,
                            router_bias=True)  # fmt: skip
    x = unambiguous_tokens(9, w["router"], config, dtype, w["router_bias"])
    want = reference_output(x, w, config, activation)
    got = layer(x)
    assert (got.double() - want).abs().max().item() <= TOLERANCE[dtype] * want.abs().max().item()
    assert layer.weight_form() == FORMS[dtype]
    # (and without the bias and clamp, the reference differs: they are not left out)
    plain = reference_output(x, {k: v for k, v in w.items() if "bias" not in k}, config)
    assert (plain - want).abs().max().item() > 10 * TOLERANCE[dtype] * want.abs().max().item()


def test_forms_that_cannot_run_gpt_oss_experts_refuse_them_by_name() -> None:
    """Experts as linear layers of a quantized method (gpt-oss's MXFP4 runs as blocks:
    tests/models/test_gpt_oss_mxfp4.py)."""
    from pyengine.layers.linear import LayerContext
    from pyengine.layers.moe.layer import FusedMoE
    from pyengine.layers.moe.linear_experts import LinearExperts
    from pyengine.layers.placement import Placement

    config = RoutingConfig("softmax", 2, 6, renormalize=True)
    gpt_oss = {"activation": ExpertActivation("clamped_swiglu"), "expert_bias": True}
    with pytest.raises(ValueError, match="quantized experts with the clamped_swiglu activation"):
        FusedMoE(64, 48, config, Placement(), method=LinearExperts(LayerContext()), **gpt_oss)
    with pytest.raises(ValueError, match="expert activation 'gelu' is not one of silu"):
        ExpertActivation("gelu")
