"""compressed-tensors' W8A8 checkpoints: int8 weights with a float scale per output
channel (`weight` int8 [out, in], `weight_scale` [out, 1]), and activations quantized to
int8 per token as each step runs, symmetric: x ~ round(x / sx) * sx, sx = max|x| / 127.

On the CPU in float32 the weight is packed once for pyengine's int8 matmul (ops.int8_dense:
AVX-512 VNNI, AVX2 or portable loops), which quantizes x, sums the int8 products in int32,
exactly, and scales: out = sx * scale * sum. Elsewhere (CUDA, 16-bit models) the same
arithmetic runs through torch._int_mm where the device has it (CUDA's int8 tensor cores,
the CPU's oneDNN), else in torch over the integers in float32 (exact while the sums stay
under 2^24).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pyengine import _C, ops
from pyengine.layers.placement import Placement
from pyengine.layers.quantization.base import LinearMethod, state_of
from pyengine.layers.quantization.shards import check_shape
from pyengine.utils import host_memory
from pyengine.utils.lazy_weights import CheckpointTensor, materialize

if TYPE_CHECKING:
    from pyengine.layers.linear import LinearBase


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(round(x / sx) as float32, sx [tokens, 1]): as ops.int8_dense quantizes."""
    x = x.float()
    scale = x.abs().amax(dim=1, keepdim=True) / 127
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round(x / safe).clamp_(-127, 127), scale


@functools.cache
def int_mm_supported(device: torch.device) -> bool:
    """Whether torch._int_mm multiplies int8 by int8 into exact int32 sums on `device`
    (CUDA's int8 tensor cores through cuBLASLt, for more than 16 rows and k, n multiples
    of 8; the CPU's oneDNN)."""
    try:
        a = torch.zeros(32, 32, device=device, dtype=torch.int8)
        torch._int_mm(a, a.t())
    except (RuntimeError, NotImplementedError):
        return False
    return True


INT_MM_MIN_ROWS = 17  # (cuBLASLt's int8 GEMM takes more than 16 rows: fewer are padded)


def checked_scales(name: str, loaded: CheckpointTensor, positive: bool) -> torch.Tensor:
    """A checkpoint's scales as float32 [n]; ValueError naming the tensor where one is not
    finite, or (positive) not above 0, or else below 0."""
    scale = materialize(loaded).float().reshape(-1)
    low = bool((scale <= 0).any()) if positive else bool((scale < 0).any())
    if not torch.isfinite(scale).all() or low:
        raise ValueError(
            f"weight {name}: scales must be finite and {'positive' if positive else 'non-negative'}"
        )
    return scale


def load_channel_scales(
    layer: LinearBase, weight_scale: torch.Tensor, name: str, loaded: CheckpointTensor,
    part: int, per_tensor: bool, positive: bool,
) -> None:  # fmt: skip
    """`weight_scale` of stacked part `part`, [out, 1] or [out] (per_tensor: or one value
    for the part, [1] or []), into this rank's rows of `weight_scale` (the layer's)."""
    full_out, start, length, local = layer.part_rows(part)
    one_value = per_tensor and math.prod(loaded.shape) == 1
    if not one_value and tuple(loaded.shape) != (full_out,):
        check_shape(name, loaded, (full_out, 1))
    scale = checked_scales(name, loaded, positive)
    if scale.numel() == 1:
        scale = scale.expand(full_out)
    weight_scale[local : local + length] = scale[start : start + length]


@dataclass
class Int8Weights:
    """A layer's scale per output channel, its int8 weight packed for ops.int8_dense (on
    the CPU in float32; else None, the weight kept as the layer's parameter), and whether
    that parameter is multiplied through torch._int_mm."""

    weight_scale: torch.Tensor
    packed: torch.Tensor | None = None
    int_mm: bool = False


class Int8W8A8Method(LinearMethod):
    weight_kinds = ("weight", "weight_scale")

    def __init__(self, placement: Placement) -> None:
        self.placement = placement

    def create_weights(self, layer: LinearBase) -> None:
        shape = (layer.output_size_per_partition, layer.input_size_per_partition)
        layer.weight = torch.nn.Parameter(torch.empty(shape, dtype=torch.int8), requires_grad=False)
        layer.method_state = Int8Weights(torch.zeros(layer.output_size_per_partition))

    def load_quantized(
        self, layer: LinearBase, name: str, kind: str, loaded: CheckpointTensor, part: int
    ) -> None:
        """The `weight_scale` of stacked part `part`: [out, 1] (or [out]), this rank's rows."""
        scale = state_of(layer, Int8Weights).weight_scale
        load_channel_scales(layer, scale, name, loaded, part, per_tensor=False, positive=False)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        held = state_of(layer, Int8Weights)
        held.weight_scale = held.weight_scale.to(self.placement.device)
        if not self.placement.packs_weights:
            layer.weight.data = layer.weight.data.to(self.placement.device)
            n, k = layer.weight.shape
            held.int_mm = n % 8 == 0 and k % 8 == 0 and int_mm_supported(self.placement.device)
            return
        q = layer.weight.data.contiguous()
        n, k = q.shape
        packed = host_memory.empty(_C.packed_int8_weight_size(k, n), torch.int8)
        _C.pack_int8_weight(packed, q)
        held.packed = packed
        del layer.weight  # the packed integers are the weight now

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        held = state_of(layer, Int8Weights)
        if held.packed is not None and x.dtype == torch.float32 and x.is_cpu:
            out = torch.empty(x.shape[0], layer.output_size_per_partition)
            ops.int8_dense(out, x, held.packed, held.weight_scale, bias, out.shape[1])
            return out
        xq, sx = quantize_per_token(x)
        if held.int_mm:  # int8 products summed exactly in int32
            rows = xq.shape[0]
            if x.is_cuda and rows < INT_MM_MIN_ROWS:
                xq = F.pad(xq, (0, 0, 0, INT_MM_MIN_ROWS - rows))
            sums = torch._int_mm(xq.to(torch.int8), layer.weight.t())[:rows]
            product = sums.float() * (sx * held.weight_scale)
        else:
            product = (xq @ layer.weight.float().t()) * (sx * held.weight_scale)
        if bias is not None:
            product = product + bias.float()
        return product.to(x.dtype)

    def held_tensors(self, layer: LinearBase) -> list[torch.Tensor]:
        held = state_of(layer, Int8Weights)
        return [held.weight_scale] + ([] if held.packed is None else [held.packed])

    def form(self, layer: LinearBase) -> str | None:
        packed = state_of(layer, Int8Weights).packed is not None
        return "int8 W8A8" if packed else super().form(layer)
