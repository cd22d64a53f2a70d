"""GGUF weights of a type with a block form (layers/block_quantized.py: the loader hands
a layer the blocks of a weight every part of which has one): kept only in that form.

- GGUFBlockMethod: on the CPU, the blocks packed for ops.dense, which every step
  multiplies from: few rows stream a fifth of float32's bytes, and for many the widening
  of each chunk into L1 is shared by all the rows' tiles. No float copy of the weight is
  ever made.
- CudaBlockMethod: on CUDA, the blocks for ops.block_gemm (cuda_blocks.py,
  PYENGINE_CUDA_BLOCK_GEMM=1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pyengine.layers.block_quantized import BlockQuantized
from pyengine.layers.placement import Placement
from pyengine.layers.quantization.base import LinearMethod, state_of
from pyengine.layers.quantization.cuda_blocks import CudaBlockForm, cuda_block_product
from pyengine.layers.quantization.packing import blocks_form, pack_block_quantized
from pyengine.layers.quantization.unquantized import PackedPanelsMethod

if TYPE_CHECKING:
    from pyengine.layers.linear import LinearBase


def gguf_method(placement: Placement, int8_activations: bool) -> LinearMethod:
    """The method of a weight whose parts all came with a GGUF block form, on a placement
    that keeps GGUF blocks (placement.keeps_gguf_blocks)."""
    if placement.packs_weights:
        return GGUFBlockMethod(int8_activations)
    return CudaBlockMethod(placement)


@dataclass
class BlockParts:
    """The block parts a layer was handed (start row, blocks), until it is processed."""

    parts: list[tuple[int, BlockQuantized]] = field(default_factory=list)


class BlockPartsMethod(LinearMethod):
    """A method that keeps a GGUF weight's block form: the parts arrive through
    load_blocks (no float weight is made), and `stacked_blocks` joins them once loaded."""

    keeps_blocks = True

    def create_weights(self, layer: LinearBase) -> None:
        layer.method_state = BlockParts()  # the blocks arrive through load_blocks

    def load_blocks(self, layer: LinearBase, start: int, blocks: BlockQuantized) -> None:
        state_of(layer, BlockParts).parts.append((start, blocks))

    @staticmethod
    def stacked_blocks(layer: LinearBase) -> BlockQuantized:
        """The layer's parts in row order as one [out, in] block form (then let go)."""
        held = state_of(layer, BlockParts)
        parts = sorted(held.parts, key=lambda part: part[0])
        shape = (layer.output_size_per_partition, layer.input_size_per_partition)
        if not parts:
            raise ValueError(f"block-quantized weight {shape} got no blocks")
        whole = BlockQuantized.stack([blocks for _, blocks in parts])
        if whole.shape != shape:
            raise ValueError(f"block-quantized weight {whole.shape} for a {shape} weight")
        held.parts.clear()
        return whole


@dataclass
class PackedBlocks:
    """A layer's blocks packed for ops.dense (its own, or a tied embedding's)."""

    packed: torch.Tensor


class GGUFBlockMethod(BlockPartsMethod, PackedPanelsMethod):
    def __init__(self, int8_activations: bool) -> None:
        self.int8_activations = int8_activations

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        packed = pack_block_quantized(self.stacked_blocks(layer), layer.gate_up)
        layer.method_state = PackedBlocks(packed)

    def packed_for(self, layer: LinearBase, rows: int) -> torch.Tensor:
        return state_of(layer, PackedBlocks).packed  # (its only form, for every step)

    def share_blocks(self, layer: LinearBase, packed: torch.Tensor) -> None:
        layer.method_state = PackedBlocks(packed)

    def held_tensors(self, layer: LinearBase) -> list[torch.Tensor]:
        return [state_of(layer, PackedBlocks).packed]

    def form(self, layer: LinearBase) -> str | None:
        return blocks_form(state_of(layer, PackedBlocks).packed)

    def panels(self, layer: LinearBase) -> torch.Tensor | None:
        return None  # (a tied embedding keeps blocks of its own: share_blocks)

    def decode_weights(self, layer: LinearBase) -> torch.Tensor | None:
        return state_of(layer, PackedBlocks).packed


class CudaBlockMethod(BlockPartsMethod):
    def __init__(self, placement: Placement) -> None:
        self.placement = placement

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        layer.method_state = CudaBlockForm(self.stacked_blocks(layer), self.placement.device)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        form = state_of(layer, CudaBlockForm)
        return cuda_block_product(form, x, bias, layer.output_size_per_partition)

    def held_tensors(self, layer: LinearBase) -> list[torch.Tensor]:
        return state_of(layer, CudaBlockForm).tensors()

    def form(self, layer: LinearBase) -> str | None:
        return state_of(layer, CudaBlockForm).describe()
