"""FusedMoE: a mixture-of-experts layer in one call: the router's logits, each token's
experts and weights (routing.py), each active expert's gate/up product, SiLU-and-multiply
and down product over the tokens routed to it, and their weighted sum. The experts are
loaded as [experts, 2 * intermediate, hidden] and [experts, hidden, intermediate] (the
gate's rows first), as transformers 5 holds them; how they are then held and multiplied
is the layer's method's (methods.py: packed panels and fused kernels on the CPU, torch
expert by expert elsewhere). A layer may also have a shared expert, which every token
takes beside its routed ones (Qwen2-MoE's, scaled by a sigmoid gate; DeepSeek's and
Llama 4's, ungated).

Over tensor-parallel ranks each rank holds a slice of every expert's intermediate size
(and of the shared expert's), or, with expert parallelism, a share of the experts whole
(and a slice of the shared expert); every rank routes every token alike (the router is
replicated), adds what its experts give, and the ranks' sums are all-reduced."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from pyengine.distributed import TensorParallelGroup
from pyengine.layers.block_quantized import BlockQuantized
from pyengine.layers.moe.activation import SILU, ExpertActivation
from pyengine.layers.moe.methods import ExpertsMethod, experts_method
from pyengine.layers.moe.routing import RoutingConfig
from pyengine.layers.moe.shared import SharedBase
from pyengine.layers.placement import Placement
from pyengine.layers.quantization.shards import copy_checked
from pyengine.utils.lazy_weights import CheckpointTensor

# A checkpoint tensor's whole shape, and what loads this rank's part of it.
FusedLoad = tuple[tuple[int, ...], Callable[[str, CheckpointTensor], None]]


class StackedLoad(NamedTuple):
    """A tensor of every expert of a layer, one part each (GGUF's ffn_gate_exps): its
    whole shape, and what loads this rank's part of it as floats, or as blocks."""

    shape: tuple[int, ...]
    floats: Callable[[str, CheckpointTensor], None]
    blocks: Callable[[BlockQuantized], None]


@dataclass(frozen=True)
class ExpertShard:
    """This rank's part of a layer's experts: experts [first, first + count), each its
    intermediate rows [start, start + size) of the layer's intermediate_size."""

    first: int
    count: int
    start: int
    size: int


class ShardedPart(NamedTuple):
    """Where a checkpoint tensor of the experts goes: `into` holds its entries [start,
    start + into.shape[dim]) along `dim`, of `whole` there."""

    into: torch.Tensor
    dim: int
    start: int
    whole: int


def expert_shard(
    num_experts: int, intermediate_size: int, tp: TensorParallelGroup, expert_parallel: bool
) -> ExpertShard:
    if expert_parallel:
        first, count = tp.split(num_experts, "num_experts")
        return ExpertShard(first, count, 0, intermediate_size)
    start, size = tp.split(intermediate_size, "the experts' intermediate size")
    return ExpertShard(0, num_experts, start, size)


class FusedMoE(nn.Module):
    # Every local expert's float weights, where its method makes them (create_experts).
    gate_up: nn.Parameter
    down: nn.Parameter

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        routing: RoutingConfig,
        placement: Placement | None = None,
        shared_intermediate_size: int = 0,
        shared_gate: bool = False,
        tp: TensorParallelGroup | None = None,
        expert_parallel: bool = False,
        method: ExpertsMethod | None = None,
        activation: ExpertActivation = SILU,
        expert_bias: bool = False,
        router_bias: bool = False,
        choice_bias: bool = False,
    ) -> None:
        """`method`: how the experts are held (experts_method's, for the placement, by
        default); `activation`: between each expert's products; expert_bias: biases on
        both products (gpt-oss's), router_bias: on the router's logits (gpt-oss's);
        choice_bias: the routing's bias on its choice of experts alone (DeepSeek-V3's
        e_score_correction_bias, float32)."""
        super().__init__()
        self.method = method or experts_method(placement or Placement())
        self.tp = tp or TensorParallelGroup()
        self.routing = routing
        self.shard = expert_shard(routing.num_experts, intermediate_size, self.tp, expert_parallel)
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = self.shard.size  # this rank's
        self.hidden_size = hidden_size
        self.shared_intermediate_size = shared_intermediate_size
        self.activation = activation
        self.router = self.parameter(routing.num_experts, hidden_size)
        self.router_bias = self.parameter(routing.num_experts) if router_bias else None
        self.choice_bias = (
            nn.Parameter(torch.zeros(routing.num_experts), requires_grad=False)
            if choice_bias
            else None
        )
        # Each local expert's biases (its intermediate rows of the gate/up one), where the
        # experts have them.
        count, n = self.shard.count, self.shard.size
        self.gate_up_bias = self.parameter(count, 2 * n) if expert_bias else None
        self.down_bias = self.parameter(count, hidden_size) if expert_bias else None
        # A GGUF file's experts come as blocks (expert_blocks, by local expert and part:
        # "gate", "up", "down"), of which no float form is made.
        self.expert_blocks: dict[tuple[int, str], BlockQuantized] = {}
        # A quantized checkpoint's: each local expert's linear layers (linear_experts.py).
        self.experts: nn.ModuleList | None = None
        self.method.create_experts(self)
        self.shared_expert: SharedBase | None = None
        if shared_intermediate_size:
            start, size = self.tp.split(shared_intermediate_size, "the shared expert's size")
            self.shared_expert = self.method.create_shared(self, start, size, shared_gate)
        self.method_state: object = None  # the method's forms, once loaded

    def parameter(self, *shape: int) -> nn.Parameter:
        """An empty weight in the method's dtype, for the loaders to fill."""
        empty = torch.empty(*shape, dtype=self.method.weight_dtype)
        return nn.Parameter(empty, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.method.apply(self, x))

    @property
    def plain_gate_up(self) -> bool:
        """Whether the gate/up product is taken whole, then the activation (not silu, or
        with a bias), rather than fused with silu_and_mul."""
        return not self.activation.fuses_with_silu or self.gate_up_bias is not None

    def process_weights_after_loading(self) -> None:
        split = self.shard.size != self.full_intermediate_size
        if self.down_bias is not None and split and self.tp.rank != 0:
            # Each rank's down product is a part of every expert's: the ranks' sums are
            # all-reduced, and the bias is added once, by the first.
            self.down_bias.data.zero_()
        self.method.process_weights_after_loading(self)

    def block_weights(self) -> int:
        """Weights held only as GGUF blocks, which no parameter counts."""
        if not self.method.keeps_blocks:
            return 0
        return 3 * self.shard.count * self.intermediate_size * self.hidden_size

    def held_tensors(self) -> list[torch.Tensor]:
        """The experts' forms that are not parameters (the model runner counts them)."""
        return self.method.held_tensors(self)

    def weight_form(self) -> str | None:
        return self.method.form(self)

    def local_experts(self) -> range:
        """The experts this rank holds, by their index in the layer."""
        return range(self.shard.first, self.shard.first + self.shard.count)

    def expert_parts(self, expert: int) -> tuple[ShardedPart, ShardedPart, ShardedPart]:
        """Where expert `expert`'s gate [intermediate, hidden], up and down [hidden,
        intermediate] weights go: views of the layer's (the checkpoint's per-expert
        tensors load into them)."""
        e, n = expert - self.shard.first, self.intermediate_size
        start, whole = self.shard.start, self.full_intermediate_size
        return (
            ShardedPart(self.gate_up[e, :n], 0, start, whole),
            ShardedPart(self.gate_up[e, n:], 0, start, whole),
            ShardedPart(self.down[e], 1, start, whole),
        )

    def copy_experts(
        self, name: str, tensor: CheckpointTensor, into: torch.Tensor, dim: int, offset: int = 0
    ) -> None:
        """This rank's part of a tensor of every expert [experts, ...] into `into`: its
        experts, and of each the intermediate entries [offset + start, offset + start + n)
        along `dim`."""
        s, n = self.shard, self.intermediate_size
        mine = tensor.narrow(0, s.first, s.count).narrow(dim, offset + s.start, n)
        copy_checked(name, into, mine)

    def load_down(self, name: str, tensor: CheckpointTensor) -> None:
        """Every expert's down [experts, hidden, intermediate], in either form."""
        self.copy_experts(name, tensor, self.down, 2)

    def fused_tensors(self) -> dict[str, FusedLoad]:
        """The experts all in one tensor each, as transformers 5 holds them and newer
        checkpoints store them: "gate_up_proj" [experts, 2 * intermediate, hidden] (the
        gate's rows first) and "down_proj" [experts, hidden, intermediate], by name."""
        n, whole, hidden = self.intermediate_size, self.full_intermediate_size, self.hidden_size
        experts = self.routing.num_experts

        def gate_up(name: str, tensor: CheckpointTensor) -> None:
            self.copy_experts(name, tensor, self.gate_up[:, :n], 1)
            self.copy_experts(name, tensor, self.gate_up[:, n:], 1, offset=whole)

        return {
            "gate_up_proj": ((experts, 2 * whole, hidden), gate_up),
            "down_proj": ((experts, hidden, whole), self.load_down),
        }

    def stacked_tensors(self) -> dict[str, StackedLoad]:
        """The experts as a GGUF file holds them, a tensor per part for every expert:
        "gate_proj" and "up_proj" [experts, intermediate, hidden], "down_proj" [experts,
        hidden, intermediate]; blocks come as a [experts * rows, columns] matrix."""
        s, n = self.shard, self.intermediate_size
        whole, hidden, experts = (
            self.full_intermediate_size,
            self.hidden_size,
            self.routing.num_experts,
        )

        def rows(part: str, into: slice) -> StackedLoad:
            def floats(name: str, tensor: CheckpointTensor) -> None:
                self.copy_experts(name, tensor, self.gate_up[:, into], 1)

            def blocks(b: BlockQuantized) -> None:
                for e in range(s.count):
                    first = (s.first + e) * whole + s.start
                    self.expert_blocks[e, part] = b.rows(first, first + n)

            return StackedLoad((experts, whole, hidden), floats, blocks)

        def down_blocks(b: BlockQuantized) -> None:
            for e in range(s.count):
                first = (s.first + e) * hidden
                self.expert_blocks[e, "down"] = b.rows(first, first + hidden).columns(
                    s.start, s.start + n
                )

        return {
            "gate_proj": rows("gate", slice(0, n)),
            "up_proj": rows("up", slice(n, 2 * n)),
            "down_proj": StackedLoad((experts, hidden, whole), self.load_down, down_blocks),
        }
