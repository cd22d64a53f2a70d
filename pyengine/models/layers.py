"""Pieces shared by the model files."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pyengine import _C, ops


@dataclass(frozen=True)
class Placement:
    """Where a model runs and in which dtype. Float32 on the CPU runs pyengine's own
    matmul over packed weights; anything else runs torch's (cuBLAS on CUDA)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32

    @property
    def packs_weights(self) -> bool:
        return self.device.type == "cpu" and self.dtype == torch.float32


def parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class DenseWeight:
    """A [out, in] weight prepared for x [tokens, in] -> [tokens, out]. On the CPU in
    float32 it is packed once into column panels for pyengine's own matmul
    (cpp/src/small_gemm.cpp): a decode step streams each weight byte once, in order: a
    decode step of 32 requests runs 1.2x faster than with torch.mm (which repacks the
    weight on every call), prefill about as fast (measured side by side in one process,
    SmolLM2-135M, 2 cores). Elsewhere it is the weight itself, for torch's matmul."""

    def __init__(self, weight: torch.Tensor, placement: Placement) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        if placement.packs_weights:
            self.packed = torch.empty(_C.packed_weight_size(self.in_features, self.out_features))
            _C.pack_weight(self.packed, weight.t().contiguous().float())
        else:
            self.weight = weight.to(placement.device, placement.dtype).contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight, bias)
        assert self.packed is not None
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        ops.dense(out, x, self.packed, bias, self.out_features)
        return out


class GatedDense:
    """silu(x @ gate) * (x @ up), an MLP's activation of its fused [gate; up] weight
    [2 * n, in]. On the CPU in float32, one op over pairs of packed panels
    (small_gemm_silu_and_mul): the [tokens, 2 * n] product never goes to memory and back.
    Elsewhere a matmul, then silu_and_mul."""

    def __init__(self, weight: torch.Tensor, placement: Placement) -> None:
        self.out_features, self.in_features = weight.shape[0] // 2, weight.shape[1]
        self.packed: torch.Tensor | None = None
        self.dense: DenseWeight | None = None
        if placement.packs_weights:
            size = 2 * _C.packed_weight_size(self.in_features, self.out_features)
            self.packed = torch.empty(size)
            _C.pack_gate_up_weight(self.packed, weight.t().contiguous().float())
        else:
            self.dense = DenseWeight(weight, placement)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        if self.dense is not None:
            ops.silu_and_mul(out, self.dense(x))
        else:
            ops.dense_silu_and_mul(out, x, self.packed, self.out_features)
        return out


def prepare_dense(
    model: nn.Module,
    names: dict[str, str],
    tied_head: bool,
    placement: Placement,
    gated: frozenset[str] = frozenset(),
) -> int:
    """Replaces each named [out, in] parameter by a DenseWeight attribute (parameter name ->
    attribute name, on the same module), or a GatedDense for the names in `gated`, the head
    too (a head tied to the embeddings gets its own), then moves the remaining parameters to
    the placement. Returns the model's number of parameters (a tied head counted once)."""
    count = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    with torch.no_grad():
        for name, attribute in names.items():
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            kind = GatedDense if name in gated else DenseWeight
            setattr(owner, attribute, kind(getattr(owner, leaf).data, placement))
            delattr(owner, leaf)
        for parameter in model.parameters():
            parameter.data = parameter.data.to(placement.device, placement.dtype)
        # After the move: a tied head that is not packed shares the embeddings' memory.
        head = model.get_parameter("embed_tokens" if tied_head else "lm_head")
        model.head = DenseWeight(head.data, placement)  # type: ignore[assignment]
        if not tied_head:
            del model.lm_head
    return count
