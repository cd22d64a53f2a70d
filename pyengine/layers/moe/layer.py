"""FusedMoE: a mixture-of-experts layer in one call: the router's logits, each token's
experts and weights (routing.py), each active expert's gate/up product, SiLU-and-multiply
and down product over the tokens routed to it, and their weighted sum. The experts are
loaded as [experts, 2 * intermediate, hidden] and [experts, hidden, intermediate] (the
gate's rows first), as transformers 5 holds them; how they are then held and multiplied
is the layer's method's (methods.py: packed panels and fused kernels on the CPU, torch
expert by expert elsewhere). A layer may also have a shared expert, which every token
takes beside its routed ones (Qwen2-MoE's, scaled by a sigmoid gate; DeepSeek's and
Llama 4's, ungated)."""

from __future__ import annotations

import torch
from torch import nn

from pyengine.layers.moe.methods import experts_method
from pyengine.layers.moe.routing import RoutingConfig
from pyengine.layers.placement import Placement


class FusedMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        routing: RoutingConfig,
        placement: Placement | None = None,
        shared_intermediate_size: int = 0,
        shared_gate: bool = False,
    ) -> None:
        super().__init__()
        self.method = experts_method(placement or Placement())
        experts, dtype = routing.num_experts, self.method.weight_dtype
        self.routing = routing
        self.intermediate_size = intermediate_size

        def parameter(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.router = parameter(experts, hidden_size)
        self.gate_up = parameter(experts, 2 * intermediate_size, hidden_size)
        self.down = parameter(experts, hidden_size, intermediate_size)
        self.shared_expert: SharedExpert | None = None
        if shared_intermediate_size:
            n = shared_intermediate_size
            self.shared_expert = SharedExpert(
                parameter(2 * n, hidden_size), parameter(hidden_size, n),
                parameter(1, hidden_size) if shared_gate else None,
            )  # fmt: skip
        self.method_state: object = None  # the method's forms, once loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def held_tensors(self) -> list[torch.Tensor]:
        """The experts' forms that are not parameters (the model runner counts them)."""
        return self.method.held_tensors(self)

    def weight_form(self) -> str | None:
        return self.method.form(self)

    def expert_parts(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert `expert`'s gate, up and down weights, as views of the layer's (the
        checkpoint's per-expert tensors load into them)."""
        n = self.intermediate_size
        return self.gate_up[expert, :n], self.gate_up[expert, n:], self.down[expert]


class SharedExpert(nn.Module):
    """The expert every token takes: gate_up [2 n, hidden] (the gate's rows first), down
    [hidden, n], and where it has one, its gate [1, hidden], which scales its output by
    sigmoid(x . gate)."""

    def __init__(
        self, gate_up: nn.Parameter, down: nn.Parameter, gate: nn.Parameter | None
    ) -> None:
        super().__init__()
        self.gate_up, self.down, self.gate = gate_up, down, gate
        self.intermediate_size = down.shape[1]

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Its gate, up and down weights, as views (the checkpoint's tensors load into
        them)."""
        n = self.intermediate_size
        return self.gate_up[:n], self.gate_up[n:], self.down
