"""A quantized checkpoint's experts (GPTQ, AWQ, compressed-tensors W4A16, W8A8 and FP8):
each expert's gate/up and down projections are linear layers of the checkpoint's own
LinearMethod, read, checked and converted as its dense layers are (one registry for
both: QuantizationMethod.experts_method). Once they are loaded the layer multiplies them
one of two ways:

- stacked: where every expert's method has panels that ops.fused_experts multiplies as
  the method itself would (LinearMethod.expert_panels: GPTQ, AWQ and W4A16 integers as
  GGUF-style blocks, FP8 weights with float activations), they are stacked an expert a
  row and the layer runs as PanelExperts (the linear layers dropped);
- looped: else (int8 or fp8 activations quantized per row before each product, groups in
  activation order, CUDA), each active expert's rows go through its linear layers, an
  expert at a time.

Under tensor parallelism each expert's layers are sharded as a dense MLP's (its
intermediate size split); with expert parallelism a rank holds whole experts. The
router, and a shared expert's gate, stay float (the checkpoints leave them so).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from pyengine.config import QuantizationConfig
from pyengine.distributed import TensorParallelGroup
from pyengine.layers.linear import LayerContext, MergedColumnParallelLinear, RowParallelLinear
from pyengine.layers.moe.methods import (
    ExpertPanels,
    ExpertsMethod,
    LoopedExperts,
    PanelExperts,
    SharedPanels,
    refuse_plain_gate_up,
    stack_packed,
)
from pyengine.layers.moe.shared import SharedBase
from pyengine.layers.quantization.base import FusablePanels
from pyengine.layers.quantization.packing import blocks_form
from pyengine.layers.quantization.registry import quantization_method

if TYPE_CHECKING:
    from pyengine.layers.moe.layer import FusedMoE
    from pyengine.models.weights import WeightRouter


class ExpertLinears(nn.Module):
    """One expert as linear layers: gate_up_proj [gate; up] (column-parallel) and
    down_proj (row-parallel; its partial sums are left to the layer, which reduces every
    expert's at once)."""

    def __init__(self, hidden_size: int, size: int, ctx: LayerContext) -> None:
        super().__init__()
        # (the names only say what the layers are: a quantized checkpoint's method is the
        # same for every layer)
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [size, size], False, ctx, ["gate_proj", "up_proj"], gate_up=True
        )
        self.down_proj = RowParallelLinear(size, hidden_size, False, ctx, ["down_proj"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj.silu_and_mul(x)
        return self.down_proj.method.apply(self.down_proj, h, None)

    def route(self, router: WeightRouter, modules: Sequence[str]) -> None:
        """Routes the checkpoint modules of its gate, up and down projections (each the
        tensors its method reads)."""
        gate, up, down = modules
        router.linear_weight(gate, self.gate_up_proj, part=0)
        router.linear_weight(up, self.gate_up_proj, part=1)
        router.linear_weight(down, self.down_proj)

    def panels(self) -> tuple[FusablePanels, FusablePanels] | None:
        """Its gate/up and down panels for the fused kernel, or None where either has
        none (or their rows would go in differently)."""
        gate_up = self.gate_up_proj.method.expert_panels(self.gate_up_proj)
        down = self.down_proj.method.expert_panels(self.down_proj)
        if gate_up is None or down is None or gate_up.int8_activations != down.int8_activations:
            return None
        return gate_up, down


class SharedLinears(SharedBase):
    """A quantized checkpoint's shared expert: its projections as linear layers (the
    gate, where it has one, float)."""

    def __init__(
        self, hidden_size: int, start: int, size: int, whole: int, gate: nn.Parameter | None,
        ctx: LayerContext,
    ) -> None:  # fmt: skip
        super().__init__(gate, start, size, whole)
        self.linears = ExpertLinears(hidden_size, whole, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaled(x, self.linears(x))

    def route(self, router: WeightRouter, modules: Sequence[str]) -> None:
        self.linears.route(router, modules)


class LinearExperts(LoopedExperts, PanelExperts):
    """The experts as linear layers of a quantized checkpoint's method, stacked for the
    fused kernel where their panels allow it, else looped over."""

    def __init__(self, ctx: LayerContext) -> None:
        PanelExperts.__init__(self, bf16=False)
        self.ctx = ctx
        self.weight_dtype = ctx.placement.dtype  # (the router's and the shared gate's)

    def create_experts(self, layer: FusedMoE) -> None:
        refuse_plain_gate_up(layer, "quantized")
        whole = layer.shard.size == layer.full_intermediate_size
        # (whole experts on a rank, as expert parallelism places them, are not split)
        ctx = replace(self.ctx, tp=TensorParallelGroup()) if whole else self.ctx
        size = layer.full_intermediate_size
        layer.experts = nn.ModuleList(
            ExpertLinears(layer.hidden_size, size, ctx) for _ in range(layer.shard.count)
        )

    def create_shared(self, layer: FusedMoE, start: int, size: int, gated: bool) -> SharedBase:
        gate = layer.parameter(1, layer.hidden_size) if gated else None
        whole = layer.shared_intermediate_size
        return SharedLinears(layer.hidden_size, start, size, whole, gate, self.ctx)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """(its linear layers are processed before it: process_weights_after_loading
        takes a module after those inside it)"""
        assert layer.experts is not None, "create_experts made them"
        linears = [e for e in layer.experts if isinstance(e, ExpertLinears)]
        shared = layer.shared_expert
        if shared is not None:
            assert isinstance(shared, SharedLinears)
            linears.append(shared.linears)
        pairs = [expert.panels() for expert in linears]
        fusable = [pair for pair in pairs if pair is not None]
        if len(fusable) < len(pairs) or len({p[0].int8_activations for p in fusable}) != 1:
            return  # (looped: the layers multiply as they are)
        self.int8_activations = fusable[0][0].int8_activations
        if shared is not None:
            gate_up, down = fusable.pop()
            gate = None if shared.gate is None else shared.gate.data[0].float().contiguous()
            size = shared.intermediate_size
            shared_panels = SharedPanels(gate_up.packed, down.packed, gate, size)
        layer.method_state = ExpertPanels(
            self.pack(layer.router.data.t(), False),
            stack_packed(len(fusable), lambda e: fusable[e][0].packed),
            stack_packed(len(fusable), lambda e: fusable[e][1].packed),
            shared_panels if shared is not None else None,
        )
        # The stacked panels are the experts now.
        del layer.router
        layer.experts = layer.shared_expert = None

    def expert(self, layer: FusedMoE, e: int, x: torch.Tensor) -> torch.Tensor:
        assert layer.experts is not None
        out: torch.Tensor = layer.experts[e](x)
        return out

    def apply(self, layer: FusedMoE, x: torch.Tensor) -> torch.Tensor:
        if isinstance(layer.method_state, ExpertPanels):
            return PanelExperts.apply(self, layer, x)
        return LoopedExperts.apply(self, layer, x)

    def held_tensors(self, layer: FusedMoE) -> list[torch.Tensor]:
        if isinstance(layer.method_state, ExpertPanels):
            return self.state(layer).tensors()
        return []  # (its linear layers count their own)

    def form(self, layer: FusedMoE) -> str | None:
        if isinstance(layer.method_state, ExpertPanels):
            return f"{blocks_form(self.state(layer).gate_up)} experts"
        return "experts as linear layers"


def quantized_experts_method(
    config: QuantizationConfig | None, ctx: LayerContext
) -> ExpertsMethod | None:
    """The method of a mixture-of-experts layer of a checkpoint quantized as `config`
    says: its format's (the quantization registry's), or linear layers of its linear
    method's; None for a float checkpoint."""
    if config is None:
        return None
    own = quantization_method(config.method).experts_method(config, ctx)
    return own or LinearExperts(ctx)
