"""LinearMethod: how a linear layer holds its weight and multiplies by it, chosen per
layer when a model is built (LinearMethods.choose).

Every method sees the same life: the layer makes a float weight [out, in] (its shard of
the checkpoint's), the loader copies the checkpoint into it (and hands block-quantized
parts to methods that keep them), then `process_weights_after_loading` turns it into
the method's form, and `apply` multiplies by it. Quantized checkpoint formats (AWQ,
GPTQ, FP8, INT8) are further methods behind the same four calls.

The forms today:
- TorchLinearMethod: the weight itself in the placement's dtype, torch's matmul (16-bit
  weights, CUDA).
- PackedPanelsMethod: float32 on the CPU, packed once into column panels for pyengine's
  own matmul (cpp/src/kernels/dense.cpp), which streams each weight byte once, in order.
- BF16PanelsMethod: a bfloat16 model's weights on the CPU as bfloat16 panels for
  pyengine's matmul (AVX512-BF16's dot products where the CPU has them).
- SplitBF16Method: the panels, and for steps of many rows a split-bfloat16 form (six
  bfloat16 tile products on AMX, as accurate as float32).
- GGUFBlockMethod: a GGUF Q4_0/Q4_1/Q8_0 weight's block form only, for every step.
- WeightOnlyIntMethod (layers/weight_only_int.py): a GPTQ or AWQ checkpoint's integers.
- Int8W8A8Method (layers/int8_w8a8.py): a compressed-tensors W8A8 checkpoint's int8
  weights, multiplied by activations quantized per token.
- Fp8Method (layers/fp8_w8a8.py): a compressed-tensors FP8 checkpoint's e4m3 weights,
  as panels of fp8 codes, and e4m3 activations.
- CudaBlockMethod (layers/cuda_blocks.py): GGUF blocks on CUDA, for ops.block_gemm
  (PYENGINE_CUDA_BLOCK_GEMM=1).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from pyengine import _C, ops
from pyengine.config import QuantizationConfig
from pyengine.layers.block_quantized import BlockQuantized
from pyengine.layers.placement import Placement
from pyengine.utils import host_memory
from pyengine.utils.lazy_weights import CheckpointTensor

if TYPE_CHECKING:
    from pyengine.layers.linear import LinearBase

# From this many rows on a weight with a split-bfloat16 form multiplies from it. Its 6
# bytes a weight stream slower than the panels' 4, so a decode step's few rows keep them.
SPLIT_MIN_ROWS = 128


def split_gemm_enabled() -> bool:
    """Whether packed weights get a split-bfloat16 form: on CPUs with AMX, unless
    PYENGINE_SPLIT_GEMM=0."""
    return os.environ.get("PYENGINE_SPLIT_GEMM", "1") != "0" and _C.split_gemm_supported()


def pack_panels(w_t: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """w_t [in, out] (a weight transposed; gate_up: [gate | up]) as float32 panels."""
    in_features, out_features = w_t.shape
    n = out_features // 2 if gate_up else out_features
    packed = host_memory.empty((2 if gate_up else 1) * _C.packed_weight_size(in_features, n))
    (_C.pack_gate_up_weight if gate_up else _C.pack_weight)(packed, w_t)
    return packed


def pack_split(w_t: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """w_t [in, out] (gate_up: [gate | up]) in split-bfloat16 form."""
    in_features, out_features = w_t.shape
    n = out_features // 2 if gate_up else out_features
    packed = host_memory.empty(_C.packed_split_weight_size(in_features, n, gate_up), torch.bfloat16)
    _C.pack_split_weight(packed, w_t, gate_up)
    return packed


def pack_bf16(w_t: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """w_t [in, out] (gate_up: [gate | up]) as bfloat16 panels, each weight rounded to
    the nearest bfloat16."""
    in_features, out_features = w_t.shape
    n = out_features // 2 if gate_up else out_features
    size = (2 if gate_up else 1) * _C.packed_bf16_weight_size(in_features, n)
    packed = host_memory.empty(size, torch.bfloat16)
    _C.pack_bf16_weight(packed, w_t.float(), gate_up)
    return packed


def pack_quantized(
    q_t: torch.Tensor, scale_t: torch.Tensor, offset_t: torch.Tensor, gate_up: bool
) -> torch.Tensor:
    """q_t [in, out] (uint8 nibbles, int8 or float8_e4m3fn) with its scale_t and offset_t
    ([in / group, out]) packed for ops.dense (gate_up: [gate | up] columns, for
    dense_silu_and_mul), the scales and offsets in the narrowest form that holds them
    exactly (float16 for GGUF's legacy types; fp8's without their zero offsets)."""
    in_features, out_features = q_t.shape
    n = out_features // 2 if gate_up else out_features
    bits = 4 if q_t.dtype == torch.uint8 else 8
    params = _C.narrowest_quant_params(q_t, scale_t, offset_t)
    size = (2 if gate_up else 1) * _C.packed_quantized_weight_size(
        in_features, n, bits, in_features // scale_t.shape[0], params
    )
    packed = host_memory.empty(size, q_t.dtype)
    _C.pack_quantized_weight(packed, q_t, scale_t, offset_t, gate_up, params)
    return packed


def pack_block_quantized(blocks: BlockQuantized, gate_up: bool = False) -> torch.Tensor:
    """blocks [out, in] packed for ops.dense (gate_up: [gate; up] for dense_silu_and_mul)."""
    q_t, scale_t, offset_t = (
        torch.from_numpy(np.ascontiguousarray(a.T)) for a in (blocks.q, blocks.scale, blocks.offset)
    )
    return pack_quantized(q_t, scale_t, offset_t, gate_up)


def packed_for(layer: LinearBase, rows: int) -> torch.Tensor:
    """The packed form a step of `rows` rows multiplies from: a block-quantized layer's
    blocks (its only form), else the split form for many rows, the float32 panels
    otherwise (each where the layer's method made it)."""
    if layer.packed_blocks is not None:
        return layer.packed_blocks
    if rows >= SPLIT_MIN_ROWS and layer.packed_split is not None:
        return layer.packed_split
    assert layer.packed is not None
    return layer.packed


class LinearMethod(ABC):
    """What a linear layer delegates its weight to. A layer with `gate_up` set holds
    [gate; up] and is applied through `apply_silu_and_mul` only."""

    # The checkpoint tensors of a layer's weight, by the suffix of their names.
    weight_kinds: tuple[str, ...] = ("weight",)
    # Whether the layer takes its weight as GGUF blocks (load_blocks) instead of floats.
    keeps_blocks = False

    def create_weights(self, layer: LinearBase) -> None:
        """Registers layer.weight [out, in] of the layer's shard, for the loader to fill."""
        weight = torch.empty(layer.output_size_per_partition, layer.input_size_per_partition)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)

    def load_quantized(
        self, layer: LinearBase, name: str, kind: str, loaded: CheckpointTensor, part: int
    ) -> None:
        """A quantized checkpoint's tensor of kind `kind` (one of weight_kinds)."""
        raise ValueError(f"weight {name}: this layer holds no {kind!r} tensor")

    def load_blocks(self, layer: LinearBase, start: int, blocks: BlockQuantized) -> None:
        """The block form of rows [start, start + rows) of the weight (GGUF's), handed
        instead of its float values to methods that keep_blocks."""
        raise ValueError(f"{type(self).__name__} takes float weights, not GGUF blocks")

    @abstractmethod
    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Turns the loaded layer.weight into this method's form (may remove it)."""

    @abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [tokens, in] @ weight.T + bias -> [tokens, out]."""

    def apply_silu_and_mul(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T) -> [tokens, out / 2]."""
        product = self.apply(layer, x, None)
        out = torch.empty(x.shape[0], product.shape[1] // 2, dtype=x.dtype, device=x.device)
        ops.silu_and_mul(out, product)
        return out


class TorchLinearMethod(LinearMethod):
    def __init__(self, placement: Placement) -> None:
        self.placement = placement

    def create_weights(self, layer: LinearBase) -> None:
        """In the model's dtype: the checkpoint's shard is converted as it is copied in,
        and no float32 copy of it ever exists."""
        shape = (layer.output_size_per_partition, layer.input_size_per_partition)
        weight = torch.empty(shape, dtype=self.placement.dtype)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        # In place: a head tied to the embeddings keeps sharing their memory.
        layer.weight.data = layer.weight.data.to(
            self.placement.device, self.placement.dtype
        ).contiguous()

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class PackedPanelsMethod(LinearMethod):
    """Float32 column panels on the CPU. The panels are made in `pack`, so that methods
    built on this one add their forms from the same transposed weight; `packed_for`
    picks among the forms a layer has, row count by row count."""

    # Whether a decode step's rows are quantized to int8 for block-quantized panels
    # (ops.dense's int8_activations; float32 panels ignore it).
    int8_activations = False

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        w_t = layer.weight.data.t().contiguous().float()
        self.pack(layer, w_t)
        del layer.weight  # the packed forms are the weight now

    def pack(self, layer: LinearBase, w_t: torch.Tensor) -> None:
        layer.packed = pack_panels(w_t, layer.gate_up)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.gate_up:  # its panels are paired for the fused op only
            raise ValueError(
                "a packed [gate; up] weight multiplies only fused with silu_and_mul: an "
                "adapter on it needs a method whose product it can join (TorchLinearMethod)"
            )
        out = torch.empty(x.shape[0], layer.output_size_per_partition, dtype=x.dtype)
        ops.dense(out, x, packed_for(layer, x.shape[0]), bias, out.shape[1], self.int8_activations)
        return out

    def apply_silu_and_mul(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        # One op over pairs of panels: the [tokens, 2 n] product never goes to memory.
        n = layer.output_size_per_partition // 2
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        ops.dense_silu_and_mul(out, x, packed_for(layer, x.shape[0]), n, self.int8_activations)
        return out


class BF16PanelsMethod(PackedPanelsMethod):
    """A bfloat16 model's weight on the CPU as bfloat16 panels: products of bfloat16s
    summed in float32 and rounded once to bfloat16, as torch's bfloat16 matmul, in the
    one pass over the weight of pyengine's own kernel (recorded into decode steps)."""

    def create_weights(self, layer: LinearBase) -> None:
        # (bfloat16 as loaded: no float32 copy of the model while it loads)
        shape = (layer.output_size_per_partition, layer.input_size_per_partition)
        weight = torch.empty(shape, dtype=torch.bfloat16)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)

    def pack(self, layer: LinearBase, w_t: torch.Tensor) -> None:
        layer.packed = pack_bf16(w_t, layer.gate_up)


class SplitBF16Method(PackedPanelsMethod):
    def pack(self, layer: LinearBase, w_t: torch.Tensor) -> None:
        super().pack(layer, w_t)
        layer.packed_split = pack_split(w_t, layer.gate_up)


class BlockPartsMethod(LinearMethod):
    """A method that keeps a GGUF weight's block form: the parts arrive through
    load_blocks (no float weight is made), and `stacked_blocks` joins them once loaded."""

    keeps_blocks = True

    def create_weights(self, layer: LinearBase) -> None:
        del layer  # the blocks arrive through load_blocks

    def load_blocks(self, layer: LinearBase, start: int, blocks: BlockQuantized) -> None:
        layer.block_parts.append((start, blocks))

    @staticmethod
    def stacked_blocks(layer: LinearBase) -> BlockQuantized:
        """The layer's parts in row order as one [out, in] block form (then let go)."""
        parts = sorted(layer.block_parts, key=lambda part: part[0])
        shape = (layer.output_size_per_partition, layer.input_size_per_partition)
        if not parts:
            raise ValueError(f"block-quantized weight {shape} got no blocks")
        whole = BlockQuantized.stack([blocks for _, blocks in parts])
        if whole.shape != shape:
            raise ValueError(f"block-quantized weight {whole.shape} for a {shape} weight")
        layer.block_parts.clear()
        return whole


class GGUFBlockMethod(BlockPartsMethod, PackedPanelsMethod):
    """A GGUF weight of a type with a block form (layers/block_quantized.py) kept only in
    it, which every step multiplies from: few rows stream a fifth of float32's bytes, and
    for many the widening of each chunk into L1 is shared by all the rows' tiles. No float
    copy of the weight is ever made."""

    def __init__(self, int8_activations: bool) -> None:
        self.int8_activations = int8_activations

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        layer.packed_blocks = pack_block_quantized(self.stacked_blocks(layer), layer.gate_up)


@dataclass(frozen=True)
class LinearMethods:
    """Chooses each layer's method from the placement and the checkpoint."""

    placement: Placement = Placement()
    # Checkpoint weight names that came with a GGUF block form.
    block_quantized: frozenset[str] = frozenset()
    # A quantized checkpoint's (GPTQ, AWQ, compressed-tensors): its layers' weights (all
    # but the head) are integers.
    quantization: QuantizationConfig | None = None
    # EngineArgs.quantized_activations: which block-quantized layers take int8 rows.
    quantized_activations: str = "float32"

    def choose(self, checkpoint_names: Sequence[str], many_rows: bool = True) -> LinearMethod:
        """The method of a layer made of `checkpoint_names` (its parts, in order);
        many_rows: whether it multiplies every token of a step (the head sees only the
        sampled rows: it keeps no split form, and stays float in a quantized checkpoint)."""
        if self.quantization is not None and many_rows:
            if self.quantization.weight_type == "float":
                from pyengine.layers.fp8_w8a8 import Fp8Method

                return Fp8Method(self.quantization, self.placement)
            if self.quantization.activation_bits:
                from pyengine.layers.int8_w8a8 import Int8W8A8Method

                return Int8W8A8Method(self.placement)
            from pyengine.layers.weight_only_int import WeightOnlyIntMethod

            return WeightOnlyIntMethod(
                self.quantization, self.placement, self.quantized_activations == "int8"
            )
        names = list(checkpoint_names)
        has_blocks = bool(names) and all(name in self.block_quantized for name in names)
        if not self.placement.packs_weights:
            if has_blocks and self.placement.keeps_gguf_blocks:
                from pyengine.layers.cuda_blocks import CudaBlockMethod

                return CudaBlockMethod(self.placement)
            if self.placement.packs_bf16_weights:
                return BF16PanelsMethod()
            return TorchLinearMethod(self.placement)
        if has_blocks:
            # every part has a block form
            return GGUFBlockMethod(self.quantized_activations == "int8")
        return SplitBF16Method() if many_rows and split_gemm_enabled() else PackedPanelsMethod()
