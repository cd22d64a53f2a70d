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
ops.block_gemm (cuda_blocks.py), as a GGUF's do. Otherwise (a row-parallel shard
with activation order, groups smaller than a block, stacked parts in orders of their own,
CUDA by default) the integers are kept and the shard is dequantized in torch each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from pyengine import ops
from pyengine.config import QuantizationConfig
from pyengine.layers.block_quantized import BLOCK, BlockQuantized
from pyengine.layers.placement import Placement
from pyengine.layers.quantization.base import FusablePanels, LinearMethod, state_of
from pyengine.layers.quantization.cuda_blocks import CudaBlockForm, cuda_block_product
from pyengine.layers.quantization.packing import blocks_form, pack_block_quantized
from pyengine.layers.quantization.shards import check_shape
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


def check_int_bits(config: QuantizationConfig, allowed: tuple[int, ...]) -> None:
    """ValueError where a GPTQ or AWQ checkpoint's weights are not of `allowed` bits."""
    if config.bits not in allowed:
        raise ValueError(
            f"{config.method} with {config.bits!r}-bit weights is not supported (bits: "
            f"{', '.join(map(str, allowed))})"
        )


def num_groups(in_features: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-in_features // group_size)


@dataclass
class IntWeights:
    """A layer's integers as loaded: q uint8 [out, in] of the shard, scales and zeros
    [out, groups] over the whole input, each stacked part's group of every input; once
    processed, either still these (dequantized each step) or only their blocks (`packed`
    on the CPU, `cuda` on CUDA), the shard's inputs taken in `input_order` (None: as
    they come)."""

    qweight: torch.Tensor | None
    scales: torch.Tensor | None
    zeros: torch.Tensor | None
    input_groups: torch.Tensor | None
    packed: torch.Tensor | None = None
    cuda: CudaBlockForm | None = None
    input_order: torch.Tensor | None = None

    def integers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qweight, scales, zeros, input_groups), where the layer keeps them."""
        q, scales, zeros, groups = self.qweight, self.scales, self.zeros, self.input_groups
        assert q is not None and scales is not None and zeros is not None and groups is not None
        return q, scales, zeros, groups


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
        # (compressed-tensors' symmetric integers are stored as q + 2^(bits - 1))
        symmetric_zero = 1 << (self.q.bits - 1) if self.q.method == "compressed-tensors" else 0
        # Each stacked part's group of every input of the shard (GPTQ's g_idx).
        first = layer.input_start
        default = self._default_groups(layer)[first : first + local_in]
        layer.method_state = IntWeights(
            qweight=torch.zeros(out, local_in, dtype=torch.uint8),
            scales=torch.zeros(out, groups),
            zeros=torch.full((out, groups), float(symmetric_zero)),
            input_groups=default.repeat(len(layer.part_bounds()), 1),
        )

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
        qweight, scales, zeros, input_groups = state_of(layer, IntWeights).integers()
        tensor = materialize(loaded)
        full_out, start, length, local = layer.part_rows(part)
        full_in = layer.input_size
        groups = num_groups(full_in, self.q.group_size)
        first_in, local_in = layer.input_start, layer.input_size_per_partition
        bits, per_word = self.q.bits, self.q.pack_factor
        awq = self.q.method == "awq"
        if kind in ("g_idx", "weight_g_idx"):
            check_shape(name, tensor, (full_in,))
            g = tensor.to(torch.int64)
            if int(g.min()) < 0 or int(g.max()) >= groups:
                raise ValueError(f"weight {name}: groups outside [0, {groups})")
            input_groups[part] = g[first_in : first_in + local_in]
            return
        if kind == "weight_shape":  # compressed-tensors: the unpacked weight's
            if [int(v) for v in tensor.reshape(-1)] != [full_out, full_in]:
                raise ValueError(
                    f"weight {name}: {tensor.tolist()}, the model expects {[full_out, full_in]}"
                )
            return
        if kind == "weight_scale":
            check_shape(name, tensor, (full_out, groups))
            value, target = tensor.float(), scales
        elif kind == "weight_packed":  # packed along the input, lowest bits first
            check_shape(name, tensor, (full_out, full_in // per_word))
            q = unpack_int32(tensor, bits, 1)[:, first_in : first_in + local_in]
            value, target = q.to(torch.uint8), qweight
        elif kind == "scales":
            check_shape(name, tensor, (groups, full_out))
            value = tensor.t().float()
            target = scales
        elif kind == "qzeros":
            packed_shape = (groups, full_out // per_word)
            check_shape(name, tensor, packed_shape)
            value = unpack_int32(tensor, bits, 1, AWQ_NIBBLE_OF_COLUMN if awq else ()).t().float()
            value = value + self.q.zero_offset
            target = zeros
        else:  # qweight
            packed_shape = (
                (full_in, full_out // per_word) if awq else (full_in // per_word, full_out)
            )
            check_shape(name, tensor, packed_shape)
            q = unpack_int32(tensor, bits, 1 if awq else 0, AWQ_NIBBLE_OF_COLUMN if awq else ())
            value = q.t()[:, first_in : first_in + local_in].to(torch.uint8)
            target = qweight
        target[local : local + length] = value[start : start + length]

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        held = state_of(layer, IntWeights)
        qweight, scales, zeros, input_groups = held.integers()
        # The blocks, where they take the weight: on the CPU in float32, and on CUDA in 16
        # bits where PYENGINE_CUDA_BLOCK_GEMM=1 (ops.block_gemm, as a GGUF's).
        cuda_blocks = not self.placement.packs_weights and self.placement.keeps_gguf_blocks
        if self.placement.packs_weights or cuda_blocks:
            order = self.block_order(input_groups)
            blocks = None if order is None else self.block_form(held, order)
            if order is not None and blocks is not None:
                # The blocks are the weight now: its integers are not kept a second time.
                if cuda_blocks:
                    held.cuda = CudaBlockForm(blocks, self.placement.device)
                else:
                    held.packed = pack_block_quantized(blocks, layer.gate_up)
                in_order = torch.equal(order, torch.arange(len(order)))
                held.input_order = None if in_order else order.to(self.placement.device)
                held.qweight = held.scales = held.zeros = held.input_groups = None
                return
        device = self.placement.device
        held.qweight, held.scales = qweight.to(device), scales.to(device)
        held.zeros, held.input_groups = zeros.to(device), input_groups.to(device)

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

    def block_form(self, held: IntWeights, order: torch.Tensor) -> BlockQuantized | None:
        """The shard, its inputs in `order`, as GGUF-style blocks of 32 inputs (q, scale,
        offset per block), or None where a scale has more than a float16's bits (then
        q * s would not be exact in float32)."""
        qweight, scales, zeros, input_groups = held.integers()
        q = qweight[:, order]
        if not torch.equal(scales, scales.half().float()):
            return None
        block_groups = input_groups[0][order][::BLOCK]  # [blocks]
        scale = scales[:, block_groups]
        zero = zeros[:, block_groups]
        if self.q.bits == 4:
            q_form = q.numpy()
            offset = -scale * zero
        else:
            q_form = (q.to(torch.int16) - 128).to(torch.int8).numpy()
            offset = scale * (128 - zero)
        return BlockQuantized(q_form, scale.numpy(), offset.numpy().astype(np.float32))

    def dequantize(self, layer: LinearBase, dtype: torch.dtype) -> torch.Tensor:
        """The shard's weight [out, in] in `dtype`."""
        q, scales, zeros, input_groups = state_of(layer, IntWeights).integers()
        weight = torch.empty(q.shape, dtype=dtype, device=q.device)
        for part, rows in enumerate(layer.part_bounds()):
            g = input_groups[part]
            weight[rows] = ((q[rows].float() - zeros[rows][:, g]) * scales[rows][:, g]).to(dtype)
        return weight

    @staticmethod
    def _in_order(held: IntWeights, x: torch.Tensor) -> torch.Tensor:
        """x's inputs in the order of the layer's blocks."""
        order = held.input_order
        return x if order is None else x.index_select(1, order)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        held = state_of(layer, IntWeights)
        if held.cuda is not None:
            n = layer.output_size_per_partition
            return cuda_block_product(held.cuda, self._in_order(held, x), bias, n)
        if held.packed is None or x.dtype != torch.float32:
            return F.linear(x, self.dequantize(layer, x.dtype), bias)
        if layer.gate_up:
            raise ValueError("paired [gate; up] blocks multiply only fused with silu_and_mul")
        x = self._in_order(held, x)
        out = torch.empty(x.shape[0], layer.output_size_per_partition, dtype=x.dtype)
        ops.dense(out, x, held.packed, bias, out.shape[1], self.int8_activations)
        return out

    def apply_silu_and_mul(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        held = state_of(layer, IntWeights)
        if held.cuda is not None or held.packed is None or x.dtype != torch.float32:
            return super().apply_silu_and_mul(layer, x)
        x = self._in_order(held, x)
        n = layer.output_size_per_partition // 2
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        ops.dense_silu_and_mul(out, x, held.packed, n, self.int8_activations)
        return out

    def decode_weights(self, layer: LinearBase) -> torch.Tensor | None:
        return state_of(layer, IntWeights).packed  # (the CPU's blocks; None on CUDA)

    def expert_panels(self, layer: LinearBase) -> FusablePanels | None:
        held = state_of(layer, IntWeights)
        if held.packed is None or held.input_order is not None:  # (rows reordered first)
            return None
        return FusablePanels(held.packed, self.int8_activations)

    def held_tensors(self, layer: LinearBase) -> list[torch.Tensor]:
        held = state_of(layer, IntWeights)
        tensors = [held.qweight, held.scales, held.zeros, held.input_groups, held.packed]
        if held.cuda is not None:
            tensors += held.cuda.tensors()
        return [t for t in tensors if t is not None]

    def form(self, layer: LinearBase) -> str | None:
        held = state_of(layer, IntWeights)
        if held.packed is not None:
            return blocks_form(held.packed)
        return held.cuda.describe() if held.cuda is not None else "integers"
