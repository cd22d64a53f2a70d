"""How a FusedMoE layer holds and multiplies its experts, chosen by where the model runs
and in what dtype (experts_method), as dense_method chooses a linear layer's form:

- PanelExperts: on the CPU in float32 or bfloat16, every expert's gate/up and down
  weights packed into the panels of pyengine's matmul, stacked an expert a row, and the
  router's as a dense weight; a step is three kernels (the router's product, the
  softmax top-k, and ops.fused_experts: the tokens grouped by expert and each active
  expert's weights read once), which a decode step records and replays.
- BlockExperts: a GGUF file's experts kept in their blocks (Q4_0 to Q8_0, the K-quants),
  packed as dense's quantized panels and multiplied by the same kernels, with float32
  activations or, as llama.cpp, int8 ones (quantized_activations).
- GroupedExperts: CUDA in 16 bits (a CUDA build, with PYENGINE_CUDA_MOE_KERNELS=1 until
  bench/gpu/run.sh has run it on a GPU): the weights as TorchExperts holds them,
  multiplied by pyengine's kernels (cuda/moe_kernels.cuh): the softmax top-k, the slots
  grouped by expert in blocks of 16, each block's gate/up and down products on tensor
  cores (every active expert's weights read once a step) and the combine.
- TorchExperts: the weights as parameters in the model's dtype, multiplied expert by
  expert with torch (float16 on the CPU, and CUDA where GroupedExperts does not run).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pyengine import _C, ops
from pyengine.layers.block_quantized import BlockQuantized
from pyengine.layers.moe.routing import kernel_route, route
from pyengine.layers.moe.shared import SharedBase, SharedExpert
from pyengine.layers.placement import Placement
from pyengine.layers.quantization.packing import (
    blocks_form,
    pack_bf16,
    pack_block_quantized,
    pack_panels,
)
from pyengine.utils import host_memory

if TYPE_CHECKING:
    from pyengine.layers.moe.layer import FusedMoE


class ExpertsMethod(ABC):
    # The dtype the layer's parameters are created in (the checkpoint's tensors are
    # converted as they are copied in).
    weight_dtype: torch.dtype = torch.float32
    # Whether the experts come as GGUF blocks (the layer makes no float parameters of
    # them; its loaders hand it the blocks).
    keeps_blocks = False

    @abstractmethod
    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Makes the forms the method multiplies from, once the weights are in."""

    @abstractmethod
    def apply(self, layer: FusedMoE, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for x [tokens, hidden]: its routed experts' weighted sum."""

    def create_experts(self, layer: FusedMoE) -> None:
        """Makes what the layer's loaders fill: here every local expert's float weights,
        layer.gate_up [experts, 2 n, hidden] (the gate's rows first) and layer.down
        [experts, hidden, n], n this rank's intermediate size."""
        experts, n, hidden = layer.shard.count, layer.intermediate_size, layer.hidden_size
        layer.gate_up = layer.parameter(experts, 2 * n, hidden)
        layer.down = layer.parameter(experts, hidden, n)

    def create_shared(self, layer: FusedMoE, start: int, size: int, gated: bool) -> SharedBase:
        """The shared expert: this rank's `size` of its intermediate rows from `start`."""
        hidden, whole = layer.hidden_size, layer.shared_intermediate_size
        return SharedExpert(
            layer.parameter(2 * size, hidden), layer.parameter(hidden, size),
            layer.parameter(1, hidden) if gated else None, start, whole,
        )  # fmt: skip

    def held_tensors(self, layer: FusedMoE) -> list[torch.Tensor]:
        return []

    def form(self, layer: FusedMoE) -> str | None:
        return None


def experts_method(
    placement: Placement, blocks: bool = False, int8_activations: bool = False
) -> ExpertsMethod:
    """The method of a layer whose experts came as GGUF blocks (`blocks`) or as floats,
    where the model runs (int8_activations: a block form's rows as llama.cpp's)."""
    if blocks and placement.keeps_gguf_blocks:
        return BlockExperts(int8_activations)
    if placement.packs_weights:
        return PanelExperts(bf16=False)
    if placement.packs_bf16_weights:
        return PanelExperts(bf16=True)
    if GroupedExperts.runs_on(placement):
        return GroupedExperts(placement)
    return TorchExperts(placement)


class LoopedExperts(ExpertsMethod):
    """Multiplies in torch, an expert at a time: each active expert's rows through it,
    weighted and added (its output, or with weights on the input, the input)."""

    @abstractmethod
    def expert(self, layer: FusedMoE, e: int, x: torch.Tensor) -> torch.Tensor:
        """This rank's local expert `e` on rows x: silu(x gate.T) * (x up.T) @ down.T."""

    def apply(self, layer: FusedMoE, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, layer.router, layer.router_bias)
        routing = route(logits, layer.routing, layer.choice_bias)
        weights = routing.weights.to(x.dtype)
        out = torch.zeros_like(x)
        local = layer.local_experts()
        for expert in torch.unique(routing.expert_ids).tolist():
            if expert not in local:
                continue  # (another rank's)
            rows, slots = torch.where(routing.expert_ids == expert)
            weight = weights[rows, slots, None]
            inputs = x[rows] * weight if routing.on_input else x[rows]
            y = self.expert(layer, expert - local.start, inputs)
            out.index_add_(0, rows, y if routing.on_input else y * weight)
        shared = layer.shared_expert
        return out if shared is None else out + shared(x)


class TorchExperts(LoopedExperts):
    def __init__(self, placement: Placement) -> None:
        # (in the model's dtype: the checkpoint's tensors are converted as they load)
        self.weight_dtype = placement.dtype
        self.device = placement.device

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        for p in layer.parameters():  # (it multiplies the parameters themselves)
            p.data = p.data.to(self.device)

    def expert(self, layer: FusedMoE, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up_bias, down_bias = layer.gate_up_bias, layer.down_bias
        product = F.linear(x, layer.gate_up[e], None if gate_up_bias is None else gate_up_bias[e])
        gate, up = product.chunk(2, dim=-1)
        return F.linear(layer.activation(gate, up), layer.down[e],
                        None if down_bias is None else down_bias[e])  # fmt: skip


class GroupedExperts(TorchExperts):
    """CUDA in float16 or bfloat16: the experts' products over the tokens' slots grouped by
    expert (pyengine/moe.h's CUDA kernels), a step's whole layer in five launches, which
    CUDA graphs capture. Sizes the tensor-core kernels do not take (a hidden or
    intermediate size not a multiple of 16) are multiplied expert by expert in torch."""

    @staticmethod
    def runs_on(placement: Placement) -> bool:
        """Whether experts_method picks it: CUDA in 16 bits, a CUDA build, and (until its
        kernels have run on a GPU) PYENGINE_CUDA_MOE_KERNELS=1."""
        return (
            placement.device.type == "cuda"
            and placement.dtype in (torch.float16, torch.bfloat16)
            and _C.built_with_cuda()
            and os.environ.get("PYENGINE_CUDA_MOE_KERNELS") == "1"
        )

    def apply(self, layer: FusedMoE, x: torch.Tensor) -> torch.Tensor:
        sizes = layer.hidden_size % 16 == 0 and layer.intermediate_size % 16 == 0
        if not sizes or layer.plain_gate_up or layer.router_bias is not None:
            return super().apply(layer, x)  # (the kernels fuse silu, and take no biases)
        config, shard = layer.routing, layer.shard
        tokens, device = x.shape[0], x.device
        x = x.contiguous()
        routing = kernel_route(F.linear(x, layer.router), config, layer.choice_bias)
        ids = routing.expert_ids.to(torch.int32).contiguous()  # (torch's routes give int64)
        weights, on_input = routing.weights.float().contiguous(), routing.on_input
        slots = tokens * config.top_k
        blocks = _C.moe_max_blocks(slots, shard.count)
        sorted_slots = torch.empty(blocks * 16, dtype=torch.int32, device=device)
        block_experts = torch.empty(blocks, dtype=torch.int32, device=device)
        ops.moe_align_blocks(sorted_slots, block_experts, ids, shard.first, shard.count)
        hidden = torch.empty(slots, layer.intermediate_size, dtype=x.dtype, device=device)
        ops.moe_expert_gemm(hidden, x, layer.gate_up, sorted_slots, block_experts, weights,
                            config.top_k, True, on_input)  # fmt: skip
        rows = torch.empty(slots, layer.hidden_size, dtype=torch.float32, device=device)
        ops.moe_expert_gemm(rows, hidden, layer.down, sorted_slots, block_experts, weights,
                            config.top_k, False, on_input)  # fmt: skip
        out = torch.empty_like(x)
        ops.moe_combine(out, rows, ids, shard.first, shard.count)
        shared = layer.shared_expert
        return out if shared is None else out + shared(x)


def refuse_plain_gate_up(layer: FusedMoE, form: str) -> None:
    """ValueError where a method that fuses silu_and_mul gets experts that need otherwise."""
    if layer.plain_gate_up or layer.router_bias is not None:
        raise ValueError(
            f"{form} experts with the {layer.activation.kind} activation or biases (gpt-oss's) "
            "are not supported"
        )


def stack_packed(count: int, pack: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """pack(e) for each of `count` experts, a row each of one [count, size] tensor in host
    memory (each packed and copied in before the next is made)."""
    first = pack(0)
    stacked = host_memory.empty(count * first.numel(), first.dtype).view(count, first.numel())
    stacked[0] = first
    for e in range(1, count):
        stacked[e] = pack(e)
    return stacked


@dataclass
class SharedPanels:
    """A shared expert's packed gate/up and down weights, and its gate (float32
    [hidden]) where it has one."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate: torch.Tensor | None
    intermediate_size: int


@dataclass
class ExpertPanels:
    """A layer's packed forms: the router's panels, the experts' stacked [experts, size]
    (gate/up pairs, and down), and its shared expert's."""

    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    shared: SharedPanels | None = None
    # (gpt-oss's, float32: the router's [experts], the experts' [experts, 2n] and
    # [experts, hidden])
    router_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        shared = self.shared
        extra = [] if shared is None else [shared.gate_up, shared.down]
        if shared is not None and shared.gate is not None:
            extra.append(shared.gate)
        biases = (self.router_bias, self.gate_up_bias, self.down_bias)
        extra += [b for b in biases if b is not None]
        return [self.router, self.gate_up, self.down, *extra]


class PanelExperts(ExpertsMethod):
    int8_activations = False  # (float panels multiply float rows)

    def __init__(self, bf16: bool) -> None:
        self.bf16 = bf16
        # (bfloat16 as loaded: no float32 copy of the experts while they load)
        self.weight_dtype = torch.bfloat16 if bf16 else torch.float32

    def pack(self, w_t: torch.Tensor, gate_up: bool) -> torch.Tensor:
        return (pack_bf16 if self.bf16 else pack_panels)(w_t.float().contiguous(), gate_up)

    def stack(self, weights: torch.Tensor, gate_up: bool) -> torch.Tensor:
        """Each expert's [out, in] weight packed, a row an expert (packed one at a time:
        a float32 copy of one expert at most)."""
        return stack_packed(weights.shape[0], lambda e: self.pack(weights[e].t(), gate_up))

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        layer.method_state = ExpertPanels(
            self.pack(layer.router.data.t(), False),
            self.stack(layer.gate_up.data, not layer.plain_gate_up),
            self.stack(layer.down.data, False),
            self.pack_shared(layer),
            *self.biases(layer),
        )
        # The packed forms are the weights now.
        del layer.router, layer.gate_up, layer.down

    def biases(self, layer: FusedMoE) -> list[torch.Tensor | None]:
        """The router's (in the rows' dtype, as dense adds it) and the experts' (float32)
        biases as the kernels take them, the layer's parameters then dropped."""
        dtypes = (torch.bfloat16 if self.bf16 else torch.float32, torch.float32, torch.float32)
        biases = [layer.router_bias, layer.gate_up_bias, layer.down_bias]
        layer.router_bias = layer.gate_up_bias = layer.down_bias = None
        return [
            None if b is None else b.data.to(dtype).contiguous()
            for b, dtype in zip(biases, dtypes, strict=True)
        ]

    def pack_shared(self, layer: FusedMoE) -> SharedPanels | None:
        """The layer's shared expert packed (its parameters then dropped), if it has one."""
        shared = layer.shared_expert
        if shared is None:
            return None
        assert isinstance(shared, SharedExpert), "create_shared made float weights"
        gate = None if shared.gate is None else shared.gate.data[0].float().contiguous()
        panels = SharedPanels(
            self.pack(shared.gate_up.data.t(), True), self.pack(shared.down.data.t(), False),
            gate, shared.intermediate_size,
        )  # fmt: skip
        layer.shared_expert = None
        return panels

    def state(self, layer: FusedMoE) -> ExpertPanels:
        state = layer.method_state
        assert isinstance(state, ExpertPanels), "process_weights_after_loading made it"
        return state

    def apply(self, layer: FusedMoE, x: torch.Tensor) -> torch.Tensor:
        panels, config = self.state(layer), layer.routing
        tokens = x.shape[0]
        logits = torch.empty(tokens, config.num_experts, dtype=x.dtype)
        ops.dense(logits, x, panels.router, panels.router_bias, config.num_experts)
        # (a kernel where the method has one: a recorded step holds it; torch's give int64
        # ids and maybe float64 weights)
        routing = kernel_route(logits, config, layer.choice_bias)
        ids, on_input = routing.expert_ids.to(torch.int32), routing.on_input
        weights = routing.weights.float()
        out = torch.empty_like(x)
        shared = panels.shared
        ops.fused_experts(
            out, x, ids, weights, panels.gate_up, panels.down, layer.intermediate_size, on_input,
            self.int8_activations,
            None if shared is None else shared.gate_up,
            None if shared is None else shared.down,
            0 if shared is None else shared.intermediate_size,
            None if shared is None else shared.gate,
            layer.shard.first, config.num_experts, panels.gate_up_bias, panels.down_bias,
            layer.activation.kind == "clamped_swiglu", layer.activation.alpha,
            layer.activation.limit,
        )  # fmt: skip
        return out

    def held_tensors(self, layer: FusedMoE) -> list[torch.Tensor]:
        return self.state(layer).tensors()

    def form(self, layer: FusedMoE) -> str | None:
        return f"{'bfloat16' if self.bf16 else 'float32'} expert panels"


class BlockExperts(PanelExperts):
    """Experts in a block form (a GGUF file's, gpt-oss's MXFP4 as 8-bit blocks): each
    expert's gate and up blocks stacked ([gate; up], paired as a fused gate/up weight's
    unless the layer takes the product whole) and packed, and its down blocks, as dense's
    quantized panels, with the experts' biases where they have them; the router (a float
    tensor) as float32 panels."""

    keeps_blocks = True

    def __init__(self, int8_activations: bool) -> None:
        super().__init__(bf16=False)
        self.int8_activations = int8_activations

    def create_experts(self, layer: FusedMoE) -> None:
        """(none: the file's blocks come to layer.expert_blocks as they load)"""

    @staticmethod
    def stack_blocks(parts: list[BlockQuantized], gate_up: bool) -> torch.Tensor:
        """Each expert's packed blocks, a row an expert (one form for all: a layer's
        experts come from one tensor each)."""
        return stack_packed(len(parts), lambda e: pack_block_quantized(parts[e], gate_up))

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        blocks: dict[tuple[int, str], BlockQuantized] = layer.expert_blocks
        experts = range(layer.shard.count)
        if len(blocks) != 3 * layer.shard.count:
            raise ValueError(f"a mixture-of-experts layer got {len(blocks)} of its "
                             f"{3 * layer.shard.count} experts' block forms")  # fmt: skip
        gate_up = [BlockQuantized.stack([blocks[e, "gate"], blocks[e, "up"]]) for e in experts]
        layer.method_state = ExpertPanels(
            self.pack(layer.router.data.t(), False),
            self.stack_blocks(gate_up, not layer.plain_gate_up),
            self.stack_blocks([blocks[e, "down"] for e in experts], False),
            self.pack_shared(layer),
            *self.biases(layer),
        )
        layer.expert_blocks = {}  # (the packed forms hold them now)
        del layer.router

    def form(self, layer: FusedMoE) -> str | None:
        return f"{blocks_form(self.state(layer).gate_up)} experts"
