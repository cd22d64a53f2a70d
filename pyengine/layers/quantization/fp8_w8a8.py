"""compressed-tensors' FP8 checkpoints: e4m3 weights (`weight` float8_e4m3fn [out, in])
with a float scale per output channel or per tensor (`weight_scale` [out, 1] or [1]), or
per block of [out, in] features (FP8_BLOCK: [ceil(out / bo), ceil(in / bi)]),
w = e4m3 * scale; activations quantized to e4m3 too, per token as each step runs
(dynamic: sx = max|x| / 448), per group of inputs of a token (FP8_BLOCK's), or by the
checkpoint's `input_scale` (static, per tensor), x ~ e4m3(x / sx) * sx; or, with no
input_activations, left float.

On the CPU in float32 the weight is held only as pyengine's quantized panels with fp8
codes (one byte a weight and a float32 scale per block of 32, no offsets: ops.dense
widens them in registers, w = e4m3 * scale rounded once, as torch dequantizes them), and the
activations go through ops.quantize_fp8_rows before each product. Elsewhere (CUDA,
16-bit models) the e4m3 weight is multiplied by torch._scaled_mm, e4m3 by e4m3 with a
scale per row of x and per channel of w, where the device has it (CUDA from sm_89; the
CPU through oneDNN), else dequantized in torch each step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pyengine import ops
from pyengine.config import QuantizationConfig
from pyengine.layers.block_quantized import BLOCK
from pyengine.layers.placement import Placement
from pyengine.layers.quantization.base import FusablePanels, LinearMethod, state_of
from pyengine.layers.quantization.int8_w8a8 import checked_scales, load_channel_scales
from pyengine.layers.quantization.packing import blocks_form, pack_quantized
from pyengine.layers.quantization.shards import check_shape
from pyengine.utils.lazy_weights import CheckpointTensor

if TYPE_CHECKING:
    from pyengine.layers.linear import LinearBase

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def fp8_rows(
    x: torch.Tensor, static_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3(x / sx) as float8_e4m3fn, sx float32 [rows, 1]): sx max|row| / 448, or
    static_scale; a row of zeros has sx 0."""
    x = x.float()
    if static_scale is not None:
        scale = static_scale.reshape(1, 1).float().expand(x.shape[0], 1)
    else:
        scale = x.abs().amax(dim=1, keepdim=True) / FP8_MAX
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (x / safe).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.contiguous()


def quantize_fp8(x: torch.Tensor, static_scale: torch.Tensor | None) -> torch.Tensor:
    """e4m3(x / sx) * sx in float32 (sx max|row| / 448, or static_scale): as
    ops.quantize_fp8_rows rounds."""
    quantized, scale = fp8_rows(x, static_scale)
    return quantized.float() * scale


@functools.cache
def scaled_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm multiplies e4m3 operands with a scale per row of x and
    per column of w into `dtype` on `device` (CUDA from sm_89 with rowwise scales; the
    CPU through oneDNN)."""
    try:
        a = torch.zeros(16, 16, device=device, dtype=FP8)
        scale = torch.ones(16, 1, device=device)
        torch._scaled_mm(a, a.t(), scale_a=scale, scale_b=scale.t(), out_dtype=dtype)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def pack_fp8(weight: torch.Tensor, scale: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """weight e4m3 [out, in] with scale [out] (a channel's) or [out, in] (each weight's,
    the same over each block of 32 inputs: FP8_BLOCK's) as fp8 panels for ops.dense
    (gate_up: [gate; up] for dense_silu_and_mul)."""
    if scale.dim() == 1:
        scale = scale[:, None].expand(-1, weight.shape[1])
    scale_t = scale[:, ::BLOCK].t().float().contiguous()  # [in / 32, out]
    # (no offsets: float32 scales alone, 1.125 bytes a weight)
    return pack_quantized(weight.t().contiguous(), scale_t, torch.zeros_like(scale_t), gate_up)


def quantize_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [rows, k] quantized to e4m3 per group of `group` inputs of a row (dynamic)."""
    return quantize_fp8(x.reshape(-1, group), None).reshape(x.shape).to(x.dtype)


@dataclass
class Fp8Weights:
    """A layer's weight scales ([out], or per block: [out, input blocks]; per weight once
    dequantized each step), its static activation scale (or None), its fp8 panels (on
    the CPU in float32; else None, the weight kept as the layer's parameter), and whether
    that parameter is multiplied through torch._scaled_mm."""

    weight_scale: torch.Tensor
    input_scale: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    scaled_mm: bool = False


class Fp8Method(LinearMethod):
    def __init__(
        self, quantization: QuantizationConfig, placement: Placement,
        scale_kind: str = "weight_scale",
    ) -> None:  # fmt: skip
        """scale_kind: the name of the weight scales' tensors (compressed-tensors'
        `weight_scale`; the fp8 quant_method's blocks' `weight_scale_inv`)."""
        self.placement = placement
        self.quantizes_activations = quantization.activation_bits == 8
        self.block = quantization.block_structure  # (out, in) features a scale, or None
        self.activation_group = quantization.activation_group
        static = quantization.static_activations
        self.weight_kinds = ("weight", scale_kind, *(("input_scale",) if static else ()))

    def create_weights(self, layer: LinearBase) -> None:
        shape = (layer.output_size_per_partition, layer.input_size_per_partition)
        layer.weight = torch.nn.Parameter(torch.empty(shape, dtype=FP8), requires_grad=False)
        # Per block: each of this rank's output rows, its scales over the whole input.
        columns = () if self.block is None else (-(-layer.input_size // self.block[1]),)
        layer.method_state = Fp8Weights(torch.zeros(shape[0], *columns))
        group = self.activation_group
        start = layer.input_start  # (a row-parallel shard's first input)
        if group and (shape[1] % group or start % group):
            raise ValueError(
                f"FP8 activations in groups of {group} inputs, and a layer shard takes "
                f"inputs [{start}, {start + shape[1]}): not whole groups"
            )

    def load_quantized(
        self, layer: LinearBase, name: str, kind: str, loaded: CheckpointTensor, part: int
    ) -> None:
        """The weight scales of stacked part `part` ([out, 1], [out], or one for the tensor:
        [1] or []; this rank's rows), or its `input_scale` (one; the parts of a fused
        layer share their input, so the largest scale serves them all, as vLLM takes it)."""
        held = state_of(layer, Fp8Weights)
        if kind != "input_scale" and self.block is not None:
            self._load_block_scales(layer, held.weight_scale, name, loaded, part)
            return
        if kind != "input_scale":
            load_channel_scales(
                layer, held.weight_scale, name, loaded, part, per_tensor=True, positive=True
            )
            return
        scale = checked_scales(name, loaded, positive=True)
        if scale.numel() != 1:
            raise ValueError(
                f"weight {name}: a static input_scale is one value, got {tuple(loaded.shape)}"
            )
        current = held.input_scale
        held.input_scale = scale if current is None else torch.maximum(current, scale)

    def _load_block_scales(
        self, layer: LinearBase, weight_scale: torch.Tensor, name: str,
        loaded: CheckpointTensor, part: int,
    ) -> None:  # fmt: skip
        """FP8_BLOCK's `weight_scale` [ceil(out / bo), ceil(in / bi)] of stacked part
        `part`: each of this rank's rows of the part takes its block row's."""
        assert self.block is not None
        full_out, start, length, local = layer.part_rows(part)
        rows_a_block = self.block[0]
        check_shape(name, loaded, (-(-full_out // rows_a_block), weight_scale.shape[1]))
        scale = checked_scales(name, loaded, positive=True).reshape(loaded.shape)
        rows = scale.repeat_interleave(rows_a_block, dim=0)[:full_out]
        weight_scale[local : local + length] = rows[start : start + length]

    def _scales_by_input(self, layer: LinearBase, weight_scale: torch.Tensor) -> torch.Tensor:
        """[out, in] of this rank: each weight's scale."""
        if self.block is None:
            return weight_scale[:, None].expand(-1, layer.input_size_per_partition)
        start = layer.input_start
        inputs = torch.arange(start, start + layer.input_size_per_partition)
        return weight_scale[:, inputs // self.block[1]]

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        held = state_of(layer, Fp8Weights)
        if bool(torch.isnan(layer.weight.data.float()).any()):
            raise ValueError(f"an FP8 weight {tuple(layer.weight.shape)} holds NaN")
        # (blocks of 32 inputs must each lie in one of a block weight's scales)
        start = layer.input_start
        within = self.block is None or (self.block[1] % BLOCK == 0 and start % BLOCK == 0)
        packs = (
            self.placement.packs_weights and layer.input_size_per_partition % BLOCK == 0 and within
        )
        if not packs and self.block is not None:  # dequantized each step: scales per weight
            held.weight_scale = self._scales_by_input(layer, held.weight_scale).contiguous()
        if not packs:
            layer.weight.data = layer.weight.data.to(self.placement.device)
            held.weight_scale = held.weight_scale.to(self.placement.device)
            if held.input_scale is not None:
                held.input_scale = held.input_scale.to(self.placement.device)
            n, k = layer.weight.shape
            held.scaled_mm = (
                self.quantizes_activations and n % 16 == 0 and k % 16 == 0
                and self.block is None and not self.activation_group
                and scaled_mm_supported(self.placement.device, self.placement.dtype)
            )  # fmt: skip
            return
        scales = self._scales_by_input(layer, held.weight_scale)
        held.packed = pack_fp8(layer.weight.data, scales, layer.gate_up)
        del layer.weight  # the fp8 panels are the weight now

    def _activations(self, held: Fp8Weights, x: torch.Tensor) -> torch.Tensor:
        if not self.quantizes_activations:
            return x
        group = self.activation_group
        if x.is_cpu and x.dtype == torch.float32:
            out = torch.empty_like(x)
            rows = (-1, group) if group else x.shape  # (groups quantize as rows of their own)
            ops.quantize_fp8_rows(out.view(rows), x.contiguous().view(rows), held.input_scale)
            return out
        if group:
            return quantize_groups(x, group)
        return quantize_fp8(x, held.input_scale).to(x.dtype)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        held = state_of(layer, Fp8Weights)
        if held.packed is not None and x.dtype == torch.float32:
            if layer.gate_up:
                raise ValueError("paired [gate; up] fp8 panels multiply only with silu_and_mul")
            out = torch.empty(x.shape[0], layer.output_size_per_partition)
            x = self._activations(held, x)
            ops.dense(out, x, held.packed, bias, out.shape[1])
            return out
        if held.scaled_mm:  # e4m3 products on the device's own FP8 GEMM
            xq, sx = fp8_rows(x, held.input_scale)
            out = torch._scaled_mm(
                xq, layer.weight.t(), scale_a=sx, scale_b=held.weight_scale[None, :],
                out_dtype=x.dtype,
            )  # fmt: skip
            return out if bias is None else out + bias
        # (e4m3 * scale rounded once, in float32, as the CPU panels widen it)
        scale = held.weight_scale if self.block is not None else held.weight_scale[:, None]
        weight = (layer.weight.float() * scale).to(x.dtype)
        return F.linear(self._activations(held, x), weight, bias)

    def apply_silu_and_mul(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        held = state_of(layer, Fp8Weights)
        if held.packed is None or x.dtype != torch.float32:
            return super().apply_silu_and_mul(layer, x)
        n = layer.output_size_per_partition // 2
        out = torch.empty(x.shape[0], n)
        ops.dense_silu_and_mul(out, self._activations(held, x), held.packed, n)
        return out

    def decode_weights(self, layer: LinearBase) -> torch.Tensor | None:
        return state_of(layer, Fp8Weights).packed

    def expert_panels(self, layer: LinearBase) -> FusablePanels | None:
        packed = state_of(layer, Fp8Weights).packed
        if packed is None or self.quantizes_activations:  # (rows quantized before each)
            return None
        return FusablePanels(packed, int8_activations=False)

    def held_tensors(self, layer: LinearBase) -> list[torch.Tensor]:
        held = state_of(layer, Fp8Weights)
        return [held.weight_scale] + ([] if held.packed is None else [held.packed])

    def form(self, layer: LinearBase) -> str | None:
        held = state_of(layer, Fp8Weights)
        return blocks_form(held.packed) if held.packed is not None else super().form(layer)
