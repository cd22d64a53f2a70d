"""Linear layers written for tensor parallelism: each holds its rank's shard of a
checkpoint weight, and its LinearMethod decides how that shard is stored and multiplied.

- ColumnParallelLinear: the output features split over the ranks (no communication).
- MergedColumnParallelLinear: several checkpoint weights stacked on the output axis
  (gate and up), each split over the ranks.
- QKVParallelLinear: q, k and v stacked, split by heads (kv heads replicated where the
  ranks outnumber them).
- RowParallelLinear: the input features split; the partial products summed over the
  group.

Weight loaders take the whole checkpoint tensor and narrow it to the rank's shard (a view:
nothing of the other ranks' rows is copied). Every layer calls its adapter hook, where a
per-row delta (LoRA) joins the base product.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from pyengine import ops
from pyengine.distributed import PipelineStage, TensorParallelGroup
from pyengine.layers.block_quantized import BlockQuantized
from pyengine.layers.placement import Placement
from pyengine.layers.quantization.choose import LinearMethods
from pyengine.layers.quantization.shards import check_shape as check_shape
from pyengine.layers.quantization.shards import copy_checked as copy_checked
from pyengine.utils import host_memory
from pyengine.utils.lazy_weights import CheckpointTensor


@dataclass(frozen=True)
class LayerContext:
    """What every layer of a model is built with."""

    placement: Placement = field(default_factory=Placement)
    tp: TensorParallelGroup = field(default_factory=TensorParallelGroup)
    pp: PipelineStage = field(default_factory=PipelineStage)
    methods: LinearMethods | None = None  # None: LinearMethods(placement)
    quantized_activations: str = "float32"  # (EngineArgs.quantized_activations)
    # Layers take adapters (LoRA): [gate; up] is multiplied as one product, the adapter's
    # delta joined, then silu_and_mul, not through the fused op's paired panels.
    adapters: bool = False
    # Mixture-of-experts layers put whole experts on the tensor-parallel ranks.
    expert_parallel: bool = False
    # Every step is whole prompts (the pooling runner's): no decode step to pack for.
    prompts_only: bool = False

    @property
    def linear_methods(self) -> LinearMethods:
        return self.methods or LinearMethods(
            self.placement, quantized_activations=self.quantized_activations
        )


class AdapterHook(Protocol):
    """Adds a per-row delta to a linear layer's product (LoRA: each row's adapter)."""

    def add_delta(self, layer: LinearBase, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [tokens, out] + the delta of x [tokens, in]; may work in place."""
        ...


class LinearBase(nn.Module):
    """A [output_size, input_size] weight of which this rank holds
    [output_size_per_partition, input_size_per_partition]."""

    weight: nn.Parameter  # the method's to create, and to remove once it has its forms
    input_start = 0  # the first input feature of the shard (a row-parallel layer's)

    def __init__(
        self,
        input_size: int,
        output_size: int,
        input_size_per_partition: int,
        output_size_per_partition: int,
        bias: bool,
        ctx: LayerContext,
        checkpoint_names: Sequence[str],
        gate_up: bool = False,
        many_rows: bool = True,
    ) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = input_size_per_partition
        self.output_size_per_partition = output_size_per_partition
        self.tp = ctx.tp
        self.gate_up = gate_up  # [gate; up], applied as silu(gate) * up
        self.adapter: AdapterHook | None = None
        # What the method keeps of the weight besides the `weight` parameter (its forms,
        # scales, the parts it is handed): its own object, which only it reads.
        self.method_state: object = None
        self.method = ctx.linear_methods.choose(checkpoint_names, many_rows)
        self.method.create_weights(self)
        self.bias = (
            nn.Parameter(torch.empty(output_size_per_partition), requires_grad=False)
            if bias
            else None
        )

    def load_blocks(self, start: int, blocks: BlockQuantized) -> None:
        self.method.load_blocks(self, start, blocks)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def block_weights(self) -> int:
        """Weights held only as GGUF blocks, which no parameter counts."""
        if not self.method.keeps_blocks:
            return 0
        return self.output_size_per_partition * self.input_size_per_partition

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors of the weight that are not parameters (its method's forms)."""
        return self.method.held_tensors(self)

    def weight_form(self) -> str | None:
        """The form the weight is held in, in words (its method's)."""
        return self.method.form(self)

    def part_rows(self, part: int) -> tuple[int, int, int, int]:
        """(output rows of stacked part `part` in the checkpoint, this rank's first and
        count, where they go in the layer): here every output row, in one part."""
        del part
        return self.output_size, 0, self.output_size, 0

    def part_bounds(self) -> list[slice]:
        """The layer's rows of each stacked part."""
        return [slice(0, self.output_size_per_partition)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Every step calls each linear layer: past nn.Module's call machinery (its hook
        # checks and two frames), which these layers do not use.
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x, self.bias)
        return out if self.adapter is None else self.adapter.add_delta(self, x, out)


class ColumnParallelLinear(LinearBase):
    """Output features split over the ranks: each rank's output is its slice of the
    whole (gather_output: the whole, gathered)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        ctx: LayerContext,
        checkpoint_names: Sequence[str],
        gather_output: bool = False,
        gate_up: bool = False,
        many_rows: bool = True,
    ) -> None:
        # Each stacked part is split over the ranks: a rank holds its slice of every part.
        self.output_sizes = list(output_sizes)
        self.shard_offsets: list[tuple[int, int]] = []  # per part: (rank's start, length)
        self.local_offsets: list[int] = []  # per part: where its slice starts in this rank
        local = 0
        for i, size in enumerate(self.output_sizes):
            start, length = self._part_slice(i, size, ctx.tp)
            self.shard_offsets.append((start, length))
            self.local_offsets.append(local)
            local += length
        super().__init__(
            input_size, sum(self.output_sizes), input_size, local, bias, ctx, checkpoint_names,
            gate_up, many_rows,
        )  # fmt: skip
        self.gather_output = gather_output

    def _part_slice(self, part: int, size: int, tp: TensorParallelGroup) -> tuple[int, int]:
        return tp.split(size, f"output size of part {part}")

    def part_rows(self, part: int) -> tuple[int, int, int, int]:
        start, length = self.shard_offsets[part]
        return self.output_sizes[part], start, length, self.local_offsets[part]

    def part_bounds(self) -> list[slice]:
        return [
            slice(offset, offset + length)
            for offset, (_, length) in zip(self.local_offsets, self.shard_offsets, strict=True)
        ]

    def weight_loader(self, name: str, kind: str, loaded: CheckpointTensor, part: int = 0) -> None:
        """Copies this rank's rows of checkpoint tensor `loaded` (part `part` of the
        stacked weight; kind: "weight" or "bias") into the layer."""
        if kind not in ("weight", "bias"):  # a quantized checkpoint's integers and scales
            self.method.load_quantized(self, name, kind, loaded, part)
            return
        full, start, length, local = self.part_rows(part)
        if kind == "weight":
            check_shape(name, loaded, (full, self.input_size))
            target = self.weight
        else:
            check_shape(name, loaded, (full,))
            assert self.bias is not None
            target = self.bias
        into = target.data.narrow(0, local, length)
        copy_checked(name, into, loaded.narrow(0, start, length))

    def load_fused(self, name: str, kind: str, loaded: CheckpointTensor) -> None:
        """A checkpoint tensor of every part stacked (GPT-2's c_attn, Phi-3's qkv_proj
        and gate_up_proj): each part's rows to it."""
        check_shape(name, loaded, (sum(self.output_sizes), *tuple(loaded.shape)[1:]))
        start = 0
        for part, size in enumerate(self.output_sizes):
            self.weight_loader(name, kind, loaded.narrow(0, start, size), part)
            start += size

    def load_part_blocks(self, blocks: BlockQuantized, part: int = 0) -> None:
        _, start, length, local = self.part_rows(part)
        self.load_blocks(local, blocks.rows(start, start + length))

    def load_fused_blocks(self, blocks: BlockQuantized) -> None:
        """load_fused's blocks: a GGUF tensor of every part stacked (Mamba-2's in_proj)."""
        first = 0
        for part, size in enumerate(self.output_sizes):
            self.load_part_blocks(blocks.rows(first, first + size), part)
            first += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return self.tp.all_gather(out) if self.gather_output else out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [gate; up] layer, [tokens, output_size_per_partition / 2]:
        fused where it is packed for it (gate_up), else the product, its adapter's delta
        joined, then silu_and_mul."""
        if self.adapter is None and self.gate_up:
            return self.method.apply_silu_and_mul(self, x)
        product = self.method.apply(self, x, None)
        if self.adapter is not None:
            product = self.adapter.add_delta(self, x, product)
        out = torch.empty(x.shape[0], product.shape[1] // 2, dtype=x.dtype, device=x.device)
        ops.silu_and_mul(out, product)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """gate and up (or any parts) stacked along the output axis; with gate_up, each rank
    holds [its gate rows; its up rows] and applies silu(gate) * up (silu_and_mul)."""


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v (parts 0, 1, 2) split by heads. Where the ranks outnumber the kv
    heads, each kv head is held by world_size / num_kv_heads ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        ctx: LayerContext,
        checkpoint_names: Sequence[str],
    ) -> None:
        tp = ctx.tp
        if num_heads % tp.world_size:
            raise ValueError(
                f"num_heads ({num_heads}) is not divisible by the tensor-parallel size "
                f"({tp.world_size})"
            )
        kv_start, self.num_kv_heads_per_partition = tp.kv_head_shard(num_kv_heads)
        self.head_size = head_size
        self.num_heads_per_partition = num_heads // tp.world_size
        self._kv_start = kv_start * head_size
        super().__init__(
            hidden_size,
            [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size],
            bias, ctx, checkpoint_names,
        )  # fmt: skip

    def _part_slice(self, part: int, size: int, tp: TensorParallelGroup) -> tuple[int, int]:
        if part == 0:
            return tp.split(size, "q size")
        return self._kv_start, self.num_kv_heads_per_partition * self.head_size

    @property
    def local_sizes(self) -> list[int]:
        """[q, k, v] features this rank holds."""
        return [length for _, length in self.shard_offsets]


class RowParallelLinear(LinearBase):
    """Input features split over the ranks (x is already this rank's slice, as a
    column-parallel layer leaves it); the partial products are summed over the group."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        ctx: LayerContext,
        checkpoint_names: Sequence[str],
    ) -> None:
        self.input_start, local = ctx.tp.split(input_size, "input size")
        super().__init__(input_size, output_size, local, output_size, bias, ctx, checkpoint_names)

    def weight_loader(self, name: str, kind: str, loaded: CheckpointTensor, part: int = 0) -> None:
        if kind == "bias":  # added once, after the sum
            assert self.bias is not None
            copy_checked(name, self.bias.data, loaded)
            return
        if kind != "weight":  # a quantized checkpoint's integers and scales
            self.method.load_quantized(self, name, kind, loaded, part)
            return
        check_shape(name, loaded, (self.output_size, self.input_size))
        shard = loaded.narrow(1, self.input_start, self.input_size_per_partition)
        copy_checked(name, self.weight.data, shard)

    def load_part_blocks(self, blocks: BlockQuantized, part: int = 0) -> None:
        end = self.input_start + self.input_size_per_partition
        self.load_blocks(0, blocks.columns(self.input_start, end))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(x)
        out = self.method.apply(self, x, None)
        if self.adapter is not None:
            out = self.adapter.add_delta(self, x, out)
        out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias


def linear_from_weight(
    weight: torch.Tensor, ctx: LayerContext, gate_up: bool = False, many_rows: bool = True
) -> MergedColumnParallelLinear:
    """A layer holding `weight` [out, in] (gate_up: [gate; up]), loaded and prepared: a
    linear layer outside a model, for tools and tests."""
    out_features, in_features = weight.shape
    sizes = [out_features // 2] * 2 if gate_up else [out_features]
    layer = MergedColumnParallelLinear(
        in_features, sizes, False, ctx, ["weight"] * len(sizes), gate_up=gate_up,
        many_rows=many_rows,
    )  # fmt: skip
    with torch.no_grad():
        for part, piece in enumerate(torch.split(weight, sizes)):
            layer.weight_loader("weight", "weight", piece, part)
        layer.process_weights_after_loading()
    return layer


def process_weights_after_loading(model: nn.Module, placement: Placement) -> int:
    """Every layer that holds a packed form makes it (the embeddings before the head tied
    to them, in build order; a module after the layers inside it, which a mixture of
    experts then stacks), then the other parameters (norms, biases) move to the
    placement. Returns the model's number of weights (a tied head counted once, a layer
    held as blocks by its shape)."""
    count = _weight_count(model)
    # The packed weights, streamed every step, go on huge pages (host_memory).
    with torch.no_grad(), host_memory.huge_page_arena():
        for module in _post_order(model):
            process = getattr(module, "process_weights_after_loading", None)
            if callable(process):
                process()
        for parameter in model.parameters():
            # (a quantized weight kept as a parameter, int8 or fp8, keeps its dtype)
            keeps = not parameter.dtype.is_floating_point or parameter.dtype.itemsize == 1
            dtype = parameter.dtype if keeps else placement.dtype
            parameter.data = parameter.data.to(placement.device, dtype)
    return count


def _post_order(module: nn.Module) -> list[nn.Module]:
    """`module` and those inside it, each once, after its children (siblings in build
    order)."""
    order = [m for child in module.children() for m in _post_order(child)]
    return list({id(m): m for m in [*order, module]}.values())


def _weight_count(model: nn.Module) -> int:
    count = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    for module in model.modules():
        block_weights = getattr(module, "block_weights", None)
        if callable(block_weights):
            count += int(block_weights())
    return count
