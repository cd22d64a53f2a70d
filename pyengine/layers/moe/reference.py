"""A mixture-of-experts layer's routed experts computed plainly in float64: the reference
its fused kernels are checked against (and the definition of what they compute)."""

from __future__ import annotations

import torch

from pyengine.layers.moe.activation import SILU, ExpertActivation
from pyengine.layers.moe.routing import Routing


def routed_experts_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    routing: Routing,
    activation: ExpertActivation = SILU,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each token's sum over its experts e of w * down_e(act(gate_e(x), up_e(x))) (with
    routing.on_input, of down_e(act(gate_e(w x), up_e(w x)))), in float64; with biases
    (gpt-oss's), gate_up_bias [experts, 2 * intermediate] added to the gate/up product,
    down_bias [experts, hidden] to the down product. x: [tokens, hidden]; gate_up:
    [experts, 2 * intermediate, hidden], the gate's rows first; down: [experts, hidden,
    intermediate]."""
    x64 = x.double()
    out = torch.zeros_like(x64)
    for expert in torch.unique(routing.expert_ids).tolist():
        rows, slots = torch.where(routing.expert_ids == expert)
        weight = routing.weights[rows, slots].double()[:, None]
        inputs = x64[rows] * weight if routing.on_input else x64[rows]
        product = inputs @ gate_up[expert].double().T
        if gate_up_bias is not None:
            product = product + gate_up_bias[expert].double()
        gate, up = product.chunk(2, dim=-1)
        y = activation(gate, up) @ down[expert].double().T
        if down_bias is not None:
            y = y + down_bias[expert].double()
        out.index_add_(0, rows, y if routing.on_input else y * weight)
    return out


def shared_expert_reference(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate: torch.Tensor | None
) -> torch.Tensor:
    """A shared expert's output for every token, in float64: down(silu(gate(x)) * up(x)),
    times sigmoid(x . gate) where it has a gate [1, hidden]. gate_up: [2 * n, hidden],
    the gate's rows first; down: [hidden, n]."""
    x64 = x.double()
    g, up = (x64 @ gate_up.double().T).chunk(2, dim=-1)
    y = (torch.nn.functional.silu(g) * up) @ down.double().T
    return y if gate is None else torch.sigmoid(x64 @ gate.double().T) * y
