"""Mixture-of-experts routing and the routed experts' float64 reference, against each
family's transformers module on random weights (random router, correction bias and
experts): the experts and weights each token gets, and the layer's output (less its
shared experts, which are dense layers). Few tokens for many experts: some experts get
no token, others several."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pyengine.layers.moe.activation import expert_activation
from pyengine.layers.moe.reference import routed_experts_reference
from pyengine.layers.moe.routing import Routing, RoutingConfig, route, routing_config

transformers = pytest.importorskip("transformers")

HIDDEN, INTERMEDIATE, TOKENS = 32, 24, 7


def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter and buffer drawn anew (transformers leaves some at zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5)
    return module.eval()


def qwen3(norm_topk_prob: bool = True) -> tuple[Any, torch.nn.Module]:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = transformers.Qwen3MoeConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=norm_topk_prob,
    )  # fmt: skip
    return config, Qwen3MoeSparseMoeBlock(config)


def mixtral() -> tuple[Any, torch.nn.Module]:
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                        num_local_experts=8, num_experts_per_tok=2)  # fmt: skip
    config.architectures = ["MixtralForCausalLM"]
    return config, MixtralSparseMoeBlock(config)


def qwen2() -> tuple[Any, torch.nn.Module]:
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = transformers.Qwen2MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE,
                                         shared_expert_intermediate_size=40, num_experts=12,
                                         num_experts_per_tok=3, norm_topk_prob=False)  # fmt: skip
    return config, Qwen2MoeSparseMoeBlock(config)


def deepseek_v3() -> tuple[Any, torch.nn.Module]:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = transformers.DeepseekV3Config(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE,
                                           n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                           topk_group=2, n_shared_experts=1,
                                           routed_scaling_factor=2.5)  # fmt: skip
    return config, DeepseekV3MoE(config)


def llama4() -> tuple[Any, torch.nn.Module]:
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    config = transformers.Llama4TextConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                           num_local_experts=8, num_experts_per_tok=1)  # fmt: skip
    return config, Llama4TextMoe(config)


def gpt_oss() -> tuple[Any, torch.nn.Module]:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = transformers.GptOssConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_local_experts=8,
        num_experts_per_tok=2,
        swiglu_limit=0.6,
    )  # (a limit the random products pass)
    return config, GptOssMLP(config)  # fmt: skip


def logits_of(block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The router's logits for x, and its correction bias (or None)."""
    router = getattr(block, "gate", None) or block.router
    if hasattr(router, "e_score_correction_bias"):
        return x @ router.weight.T, router.e_score_correction_bias
    bias = getattr(router, "bias", None)  # (gpt-oss's router has a bias)
    return x @ router.weight.T + (0 if bias is None else bias), None


def experts_of(block: torch.nn.Module) -> dict[str, torch.Tensor]:
    """gate_up [experts, 2 * intermediate, hidden] (the gate's rows first), down [experts,
    hidden, intermediate], and where they have them, their biases (gpt-oss's, whose gate
    and up rows alternate)."""
    experts = block.experts
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if gate_up.shape[-1] != HIDDEN:  # (Llama 4 and gpt-oss keep them transposed)
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    forms = {"gate_up": gate_up, "down": down}
    if hasattr(experts, "gate_up_proj_bias"):
        forms["gate_up"] = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
        bias = experts.gate_up_proj_bias
        forms["gate_up_bias"] = torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1)
        forms["down_bias"] = experts.down_proj_bias
    return forms


def shared_part(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the block adds besides its routed experts (its shared experts)."""
    if hasattr(block, "shared_expert_gate"):  # Qwen2-MoE: a sigmoid-gated shared expert
        return torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    for name in ("shared_experts", "shared_expert"):
        if hasattr(block, name):
            return getattr(block, name)(x)
    return torch.zeros_like(x)


FAMILIES: dict[str, Callable[[], tuple[Any, torch.nn.Module]]] = {
    "qwen3_moe": qwen3,
    "qwen3_moe_unnormalized": lambda: qwen3(norm_topk_prob=False),
    "mixtral": mixtral,
    "qwen2_moe": qwen2,
    "deepseek_v3": deepseek_v3,
    "llama4": llama4,
    "gpt_oss": gpt_oss,
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_routing_and_routed_experts_match_transformers(family: str) -> None:
    config, block = FAMILIES[family]()
    randomized(block, seed=len(family))
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, bias = logits_of(block, x)
        routing = route(logits, routing_config(config), bias)
        whole = block(x[None])
        whole = (whole[0] if isinstance(whole, tuple) else whole).reshape(TOKENS, HIDDEN)
        routed = whole - shared_part(block, x)
        w = experts_of(block)
        expected = routed_experts_reference(x, w["gate_up"], w["down"], routing,
                                            expert_activation(config), w.get("gate_up_bias"),
                                            w.get("down_bias"))  # fmt: skip
    torch.testing.assert_close(routed.double(), expected, rtol=1e-4, atol=1e-4)
    assert routing.expert_ids.shape == (TOKENS, config.num_experts_per_tok)
    assert (routing.expert_ids.sort(-1).values.diff(dim=-1) > 0).all()  # distinct per token


def test_the_reference_leaves_out_experts_with_no_token() -> None:
    """Experts no token chose contribute nothing, however large their weights."""
    gate_up = torch.randn(4, 2 * INTERMEDIATE, HIDDEN, dtype=torch.float64)
    down = torch.randn(4, HIDDEN, INTERMEDIATE, dtype=torch.float64)
    x = torch.randn(3, HIDDEN, dtype=torch.float64)
    ids = torch.tensor([[0, 2], [2, 0], [0, 2]])
    weights = torch.rand(3, 2)
    before = routed_experts_reference(x, gate_up, down, Routing(ids, weights))
    gate_up[1] *= 1e6
    gate_up[3] = float("nan")
    assert torch.equal(routed_experts_reference(x, gate_up, down, Routing(ids, weights)), before)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [({"method": "top1", "top_k": 1, "num_experts": 4}, "is not one of softmax"),
     ({"method": "softmax", "top_k": 5, "num_experts": 4}, "top_k 5 must be in"),
     ({"method": "grouped_sigmoid", "top_k": 2, "num_experts": 6, "num_groups": 4},
      "do not split into 4 groups"),
     ({"method": "grouped_sigmoid", "top_k": 4, "num_experts": 8, "num_groups": 4,
       "topk_groups": 1}, "cannot hold top_k 4")],
)  # fmt: skip
def test_a_routing_that_cannot_run_names_its_field(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        RoutingConfig(**fields)
    with pytest.raises(ValueError, match=r"router logits must be \[tokens, 4\]"):
        route(torch.zeros(3, 5), RoutingConfig("softmax", 2, 4))
