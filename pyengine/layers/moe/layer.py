"""FusedMoE: a mixture-of-experts layer in one call: the router's logits, each token's
experts and weights (routing.py), each active expert's gate/up product, SiLU-and-multiply
and down product over the tokens routed to it, and their weighted sum. The experts are
held as [experts, 2 * intermediate, hidden] and [experts, hidden, intermediate] (the
gate's rows first), as transformers 5 holds them.

This first form computes with torch's matmuls, expert by expert, in the model's dtype,
as transformers does (so that float32 tokens match its); the fused CPU and CUDA kernels,
quantized experts and tensor or expert parallelism are issue 49's next parts."""

from __future__ import annotations

import torch
from torch import nn

from pyengine.layers.moe.routing import RoutingConfig, route


class FusedMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, routing: RoutingConfig) -> None:
        super().__init__()
        experts = routing.num_experts
        self.routing = routing
        self.router = nn.Parameter(torch.empty(experts, hidden_size), requires_grad=False)
        self.gate_up = nn.Parameter(
            torch.empty(experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.down = nn.Parameter(
            torch.empty(experts, hidden_size, intermediate_size), requires_grad=False
        )
        self.intermediate_size = intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = route(torch.nn.functional.linear(x, self.router), self.routing)
        weights = routing.weights.to(x.dtype)
        out = torch.zeros_like(x)
        for expert in torch.unique(routing.expert_ids).tolist():
            rows, slots = torch.where(routing.expert_ids == expert)
            weight = weights[rows, slots, None]
            inputs = x[rows] * weight if routing.on_input else x[rows]
            gate, up = torch.nn.functional.linear(inputs, self.gate_up[expert]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.down[expert])
            out.index_add_(0, rows, y if routing.on_input else y * weight)
        return out

    def expert_parts(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert `expert`'s gate, up and down weights, as views of the layer's (the
        checkpoint's per-expert tensors load into them)."""
        n = self.intermediate_size
        return self.gate_up[expert, :n], self.gate_up[expert, n:], self.down[expert]
