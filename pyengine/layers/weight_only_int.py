"""GPTQ, AWQ and compressed-tensors W4A16 checkpoints: 4- or 8-bit integer weights in
groups of input features, each group with a scale and a zero point, read from their
packed int32 forms and held in quantized form only.

The checkpoint layouts (W is the [out, in] weight, q its integers, g a group):
- GPTQ (AutoGPTQ, GPTQModel): qweight int32 [in / (32 / bits), out], packed along the
  input, lowest bits first; qzeros int32 [groups, out / (32 / bits)], packed along the
  output; scales [groups, out]; g_idx int32 [in], each input's group (activation order
  with desc_act). W[o, i] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o]), the
  stored zero less 1 in the original "gptq" format.
- AWQ (AutoAWQ's GEMM): qweight int32 [in, out / 8], qzeros int32 [in / group, out / 8],
  both packed along the output in the order 0, 2, 4, 6, 1, 3, 5, 7; scales
  [in / group, out]; W[o, i] = scales[i // group, o] * (q[i, o] - zero[i // group, o]).
- compressed-tensors pack-quantized (W4A16, symmetric): weight_packed int32 [out, in / 8],
  packed along the input, lowest bits first, each q stored as q + 8; weight_scale [out,
  in / group]; weight_shape [out, in]. W[o, i] = weight_scale[o, i // group] * q, or,
  with actorder "group", weight_scale[o, weight_g_idx[i]] * q.

Loaded per rank as q uint8 [out, in] of its shard, scales and zeros [out, groups] over
the whole input (a row-parallel shard's inputs may fall in any group with activation
order), and each stacked part's input groups.

Multiplied, on the CPU in float32, by pyengine's block-quantized matmul (ops.dense over
GGUF's Q4_1/Q8_0 block form, layers/block_quantized.py) wherever every block of 32
inputs lies in one group, in the checkpoint's order or, with activation order, once the
inputs are sorted by group (x's columns are then taken in that order): w = s (q - z)
is q * s + (-s z) there (or, at 8 bits, (q - 128) * s + s (128 - z)), products that are
exact in float32, so the weights are the same bits. The blocks are then the layer's only
form. On CUDA in 16 bits with PYENGINE_CUDA_BLOCK_GEMM=1 the same blocks go to
ops.block_gemm (layers/cuda_blocks.py), as a GGUF's do. Otherwise (a row-parallel shard
with activation order, groups smaller than a block, stacked parts in orders of their own,
CUDA by default) the integers are kept and the shard is dequantized in torch each step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from pyengine import ops
from pyengine.config import QuantizationConfig
from pyengine.layers.block_quantized import BLOCK, BlockQuantized
from pyengine.layers.cuda_blocks import CudaBlockForm, cuda_block_product
from pyengine.layers.linear_method import LinearMethod, pack_block_quantized
from pyengine.layers.placement import Placement
from pyengine.utils.lazy_weights import CheckpointTensor, materialize

if TYPE_CHECKING:
    from pyengine.layers.linear import LinearBase

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column of each nibble of an int32
AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_ORDER.index(column) for column in range(8))


def unpack_int32(
    packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] = ()
) -> torch.Tensor:
    """The integers packed 32 / bits to an int32 along `dim`, lowest bits first (or, with
    `order`, position p in nibble order[p]), as int16 with `dim` widened."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights are int32, got {packed.dtype}")
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    moved = packed.movedim(dim, -1)
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per_word]
    if order:
        values = values[..., list(order)]
    widened = values.reshape(*moved.shape[:-1], moved.shape[-1] * per_word)
    return widened.movedim(-1, dim).to(torch.int16)


def part_rows(layer: LinearBase, part: int) -> tuple[int, int, int, int]:
    """(output rows of stacked part `part` in the checkpoint, this rank's first and count,
    where they go in the layer)."""
    from pyengine.layers.linear import ColumnParallelLinear

    if not isinstance(layer, ColumnParallelLinear):  # row-parallel: every output row
        return layer.output_size, 0, layer.output_size, 0
    start, length = layer.shard_offsets[part]
    return layer.output_sizes[part], start, length, layer.local_offsets[part]


def num_groups(in_features: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-in_features // group_size)


class WeightOnlyIntMethod(LinearMethod):
    def __init__(
        self, quantization: QuantizationConfig, placement: Placement, int8_activations: bool
    ) -> None:
        self.q = quantization
        self.placement = placement
        self.int8_activations = int8_activations  # (for its block form: ops.dense's)
        kinds: tuple[str, ...] = ("qweight", "qzeros", "scales")
        if quantization.method == "compressed-tensors":  # pack-quantized, symmetric
            kinds = ("weight_packed", "weight_scale", "weight_shape")
            if quantization.desc_act:
                kinds = (*kinds, "weight_g_idx")  # its activation order's groups
        self.weight_kinds = (*kinds, "g_idx") if quantization.method == "gptq" else kinds

    def create_weights(self, layer: LinearBase) -> None:
        out, local_in = layer.output_size_per_partition, layer.input_size_per_partition
        groups = num_groups(layer.input_size, self.q.group_size)
        parts = len(getattr(layer, "output_sizes", [out]))
        layer.register_buffer("qweight", torch.zeros(out, local_in, dtype=torch.uint8))
        layer.register_buffer("scales", torch.zeros(out, groups))
        # (compressed-tensors' symmetric integers are stored as q + 2^(bits - 1))
        symmetric_zero = 1 << (self.q.bits - 1) if self.q.method == "compressed-tensors" else 0
        layer.register_buffer("zeros", torch.full((out, groups), float(symmetric_zero)))
        # Each stacked part's group of every input of the shard (GPTQ's g_idx).
        first = getattr(layer, "input_start", 0)
        default = self._default_groups(layer)[first : first + local_in]
        layer.register_buffer("input_groups", default.repeat(parts, 1))

    def _default_groups(self, layer: LinearBase) -> torch.Tensor:
        full = layer.input_size
        if self.q.group_size == -1:
            return torch.zeros(full, dtype=torch.int64)
        return torch.arange(full, dtype=torch.int64) // self.q.group_size

    def load_quantized(
        self, layer: LinearBase, name: str, kind: str, loaded: CheckpointTensor, part: int
    ) -> None:
        """Checkpoint tensor `name` (kind qweight, qzeros, scales or g_idx) of stacked
        part `part`: this rank's rows (column-parallel) or inputs (row-parallel)."""
        from pyengine.layers.linear import check_shape

        tensor = materialize(loaded)
        full_out, start, length, local = part_rows(layer, part)
        full_in = layer.input_size
        groups = num_groups(full_in, self.q.group_size)
        first_in, local_in = getattr(layer, "input_start", 0), layer.input_size_per_partition
        bits, per_word = self.q.bits, self.q.pack_factor
        awq = self.q.method == "awq"
        if kind in ("g_idx", "weight_g_idx"):
            check_shape(name, tensor, (full_in,))
            g = tensor.to(torch.int64)
            if int(g.min()) < 0 or int(g.max()) >= groups:
                raise ValueError(f"weight {name}: groups outside [0, {groups})")
            layer.input_groups[part] = g[first_in : first_in + local_in]
            return
        if kind == "weight_shape":  # compressed-tensors: the unpacked weight's
            if [int(v) for v in tensor.reshape(-1)] != [full_out, full_in]:
                raise ValueError(
                    f"weight {name}: {tensor.tolist()}, the model expects {[full_out, full_in]}"
                )
            return
        if kind == "weight_scale":
            check_shape(name, tensor, (full_out, groups))
            value, target = tensor.float(), layer.scales
        elif kind == "weight_packed":  # packed along the input, lowest bits first
            check_shape(name, tensor, (full_out, full_in // per_word))
            q = unpack_int32(tensor, bits, 1)[:, first_in : first_in + local_in]
            value, target = q.to(torch.uint8), layer.qweight
        elif kind == "scales":
            check_shape(name, tensor, (groups, full_out))
            value = tensor.t().float()
            target = layer.scales
        elif kind == "qzeros":
            packed_shape = (groups, full_out // per_word)
            check_shape(name, tensor, packed_shape)
            value = unpack_int32(tensor, bits, 1, AWQ_NIBBLE_OF_COLUMN if awq else ()).t().float()
            value = value + self.q.zero_offset
            target = layer.zeros
        else:  # qweight
            packed_shape = (
                (full_in, full_out // per_word) if awq else (full_in // per_word, full_out)
            )
            check_shape(name, tensor, packed_shape)
            q = unpack_int32(tensor, bits, 1 if awq else 0, AWQ_NIBBLE_OF_COLUMN if awq else ())
            value = q.t()[:, first_in : first_in + local_in].to(torch.uint8)
            target = layer.qweight
        target[local : local + length] = value[start : start + length]

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        layer.input_order = None
        # The blocks, where they take the weight: on the CPU in float32, and on CUDA in 16
        # bits where PYENGINE_CUDA_BLOCK_GEMM=1 (ops.block_gemm, as a GGUF's).
        cuda_blocks = not self.placement.packs_weights and self.placement.keeps_gguf_blocks
        if self.placement.packs_weights or cuda_blocks:
            order = self.block_order(layer.input_groups)
            blocks = None if order is None else self.block_form(layer, order)
            if order is not None and blocks is not None:
                # The blocks are the weight now: its integers are not kept a second time.
                if cuda_blocks:
                    layer.cuda_blocks = CudaBlockForm(blocks, self.placement.device)
                else:
                    layer.packed_blocks = pack_block_quantized(blocks, layer.gate_up)
                in_order = torch.equal(order, torch.arange(len(order)))
                layer.input_order = None if in_order else order.to(self.placement.device)
                for attr in ("qweight", "scales", "zeros", "input_groups"):
                    delattr(layer, attr)
                return
        for attr in ("qweight", "scales", "zeros", "input_groups"):
            setattr(layer, attr, getattr(layer, attr).to(self.placement.device))

    @staticmethod
    def block_order(groups: torch.Tensor) -> torch.Tensor | None:
        """An order of the shard's inputs in which every block of 32 lies in one group, for
        every stacked part (activation order puts them in a permutation: sorting by
        group, shared by parts that share their g_idx, as q/k/v and gate/up do), or None."""
        if not all(torch.equal(groups[0], g) for g in groups[1:]):
            return None
        order = torch.sort(groups[0], stable=True).indices
        grouped = groups[0][order]
        if len(order) % BLOCK or not torch.equal(
            grouped.view(-1, BLOCK), grouped[::BLOCK, None].expand(-1, BLOCK)
        ):
            return None
        return order

    def block_form(self, layer: LinearBase, order: torch.Tensor) -> BlockQuantized | None:
        """The shard, its inputs in `order`, as GGUF-style blocks of 32 inputs (q, scale,
        offset per block), or None where a scale has more than a float16's bits (then
        q * s would not be exact in float32)."""
        q, scales, zeros = layer.qweight[:, order], layer.scales, layer.zeros
        if not torch.equal(scales, scales.half().float()):
            return None
        block_groups = layer.input_groups[0][order][::BLOCK]  # [blocks]
        scale = scales[:, block_groups]
        zero = zeros[:, block_groups]
        if self.q.bits == 4:
            q_form = q.numpy()
            offset = -scale * zero
        else:
            q_form = (q.to(torch.int16) - 128).to(torch.int8).numpy()
            offset = scale * (128 - zero)
        return BlockQuantized(q_form, scale.numpy(), offset.numpy().astype(np.float32))

    def _part_bounds(self, layer: LinearBase) -> list[slice]:
        """The layer's rows of each stacked part."""
        from pyengine.layers.linear import ColumnParallelLinear

        if not isinstance(layer, ColumnParallelLinear):
            return [slice(0, layer.output_size_per_partition)]
        return [
            slice(offset, offset + length)
            for offset, (_, length) in zip(layer.local_offsets, layer.shard_offsets, strict=True)
        ]

    def dequantize(self, layer: LinearBase, dtype: torch.dtype) -> torch.Tensor:
        """The shard's weight [out, in] in `dtype`."""
        q, scales, zeros = layer.qweight, layer.scales, layer.zeros
        weight = torch.empty(q.shape, dtype=dtype, device=q.device)
        for part, rows in enumerate(self._part_bounds(layer)):
            g = layer.input_groups[part]
            weight[rows] = ((q[rows].float() - zeros[rows][:, g]) * scales[rows][:, g]).to(dtype)
        return weight

    def _blocks_for(self, layer: LinearBase, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the packed blocks, x's inputs in their order)."""
        assert layer.packed_blocks is not None
        order = layer.input_order
        return layer.packed_blocks, x if order is None else x.index_select(1, order)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.cuda_blocks is not None:
            order = layer.input_order
            x = x if order is None else x.index_select(1, order)
            return cuda_block_product(layer.cuda_blocks, x, bias, layer.output_size_per_partition)
        if layer.packed_blocks is None or x.dtype != torch.float32:
            return F.linear(x, self.dequantize(layer, x.dtype), bias)
        if layer.gate_up:
            raise ValueError("paired [gate; up] blocks multiply only fused with silu_and_mul")
        packed, x = self._blocks_for(layer, x)
        out = torch.empty(x.shape[0], layer.output_size_per_partition, dtype=x.dtype)
        ops.dense(out, x, packed, bias, out.shape[1], self.int8_activations)
        return out

    def apply_silu_and_mul(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if layer.cuda_blocks is not None or layer.packed_blocks is None or x.dtype != torch.float32:
            return super().apply_silu_and_mul(layer, x)
        packed, x = self._blocks_for(layer, x)
        n = layer.output_size_per_partition // 2
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        ops.dense_silu_and_mul(out, x, packed, n, self.int8_activations)
        return out
