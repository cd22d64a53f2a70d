"""Float weights (a float checkpoint's, and a quantized one's head): the dense forms, and
the one place that chooses among them (dense_method), by where the model runs and in what
dtype, never by the checkpoint's format.

- TorchLinearMethod: the weight itself in the placement's dtype, torch's matmul (16-bit
  weights, CUDA).
- PackedPanelsMethod: float32 on the CPU, packed once into column panels for pyengine's
  own matmul (cpp/src/kernels/dense.cpp), which streams each weight byte once, in order.
- BF16PanelsMethod: a bfloat16 model's weights on the CPU as bfloat16 panels for
  pyengine's matmul (AVX512-BF16's dot products where the CPU has them).
- SplitBF16Method: the panels, and for steps of many rows a split-bfloat16 form (six
  bfloat16 tile products on AMX, as accurate as float32).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pyengine import _C, ops
from pyengine.layers.placement import Placement
from pyengine.layers.quantization.base import LinearMethod, state_of
from pyengine.layers.quantization.packing import pack_bf16, pack_panels, pack_split

if TYPE_CHECKING:
    from pyengine.layers.linear import LinearBase

# From this many rows on a weight with a split-bfloat16 form multiplies from it. Its 6
# bytes a weight stream slower than the panels' 4, so a decode step's few rows keep them.
SPLIT_MIN_ROWS = 128


def split_gemm_enabled() -> bool:
    """Whether packed weights get a split-bfloat16 form: on CPUs with AMX, unless
    PYENGINE_SPLIT_GEMM=0."""
    return os.environ.get("PYENGINE_SPLIT_GEMM", "1") != "0" and _C.split_gemm_supported()


def dense_method(placement: Placement, many_rows: bool) -> LinearMethod:
    """The method of a float weight: packed panels on the CPU in float32 (with a split
    form where the layer multiplies many rows and the CPU has AMX), bfloat16 panels for a
    bfloat16 model on the CPU, torch's matmul otherwise."""
    if placement.packs_weights:
        return SplitBF16Method() if many_rows and split_gemm_enabled() else PackedPanelsMethod()
    if placement.packs_bf16_weights:
        return BF16PanelsMethod()
    return TorchLinearMethod(placement)


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


@dataclass
class Panels:
    """A packed layer's forms: its panels, and a split form for many rows (or None)."""

    panels: torch.Tensor
    split: torch.Tensor | None = None


class PackedPanelsMethod(LinearMethod):
    """Float32 column panels on the CPU. The panels are made in `pack`, so that methods
    built on this one add their forms from the same transposed weight; `packed_for`
    picks among the forms a layer has, row count by row count."""

    # Whether a decode step's rows are quantized to int8 for block-quantized panels
    # (ops.dense's int8_activations; float32 panels ignore it).
    int8_activations = False

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        w_t = layer.weight.data.t().contiguous().float()
        layer.method_state = self.pack(w_t, layer.gate_up)
        del layer.weight  # the packed forms are the weight now

    def pack(self, w_t: torch.Tensor, gate_up: bool) -> Panels:
        return Panels(pack_panels(w_t, gate_up))

    def packed_for(self, layer: LinearBase, rows: int) -> torch.Tensor:
        """The packed form a step of `rows` rows multiplies from: the split form for many
        rows where the layer has one, the panels otherwise."""
        forms = state_of(layer, Panels)
        if rows >= SPLIT_MIN_ROWS and forms.split is not None:
            return forms.split
        return forms.panels

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.gate_up:  # its panels are paired for the fused op only
            raise ValueError(
                "a packed [gate; up] weight multiplies only fused with silu_and_mul: an "
                "adapter on it needs a method whose product it can join (TorchLinearMethod)"
            )
        out = torch.empty(x.shape[0], layer.output_size_per_partition, dtype=x.dtype)
        packed = self.packed_for(layer, x.shape[0])
        ops.dense(out, x, packed, bias, out.shape[1], self.int8_activations)
        return out

    def apply_silu_and_mul(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        # One op over pairs of panels: the [tokens, 2 n] product never goes to memory.
        n = layer.output_size_per_partition // 2
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        packed = self.packed_for(layer, x.shape[0])
        ops.dense_silu_and_mul(out, x, packed, n, self.int8_activations)
        return out

    def held_tensors(self, layer: LinearBase) -> list[torch.Tensor]:
        forms = state_of(layer, Panels)
        return [forms.panels] + ([] if forms.split is None else [forms.split])

    def form(self, layer: LinearBase) -> str | None:
        return f"{str(state_of(layer, Panels).panels.dtype).removeprefix('torch.')} panels"

    def panels(self, layer: LinearBase) -> torch.Tensor | None:
        return state_of(layer, Panels).panels


class BF16PanelsMethod(PackedPanelsMethod):
    """A bfloat16 model's weight on the CPU as bfloat16 panels: products of bfloat16s
    summed in float32 and rounded once to bfloat16, as torch's bfloat16 matmul, in the
    one pass over the weight of pyengine's own kernel (recorded into decode steps)."""

    def create_weights(self, layer: LinearBase) -> None:
        # (bfloat16 as loaded: no float32 copy of the model while it loads)
        shape = (layer.output_size_per_partition, layer.input_size_per_partition)
        weight = torch.empty(shape, dtype=torch.bfloat16)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)

    def pack(self, w_t: torch.Tensor, gate_up: bool) -> Panels:
        return Panels(pack_bf16(w_t, gate_up))


class SplitBF16Method(PackedPanelsMethod):
    def pack(self, w_t: torch.Tensor, gate_up: bool) -> Panels:
        forms = super().pack(w_t, gate_up)
        forms.split = pack_split(w_t, gate_up)
        return forms
