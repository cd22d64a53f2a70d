"""Pieces shared by the model files."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pyengine import _C, host_memory, ops
from pyengine.loader.block_quantized import BlockQuantized


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


# Up to this many rows, a weight with a block-quantized form multiplies from it: a step
# of few rows is bound by streaming the weights, and those bytes are a fifth (SmolLM2's
# matmuls for one row: 13 ms against 26 from the float32 panels, for 16 rows 29 against
# 38). With more rows the arithmetic binds, and the float32 panels skip the widening (32
# rows: level; a prefill: 15-20% faster).
BLOCK_QUANTIZED_MAX_ROWS = 16

# From this many rows on, a weight with a split-bfloat16 form (CPUs with AMX) multiplies
# from it: six bfloat16 tile products, as accurate as float32, run a prefill's matmuls
# about 1.3x faster than the float32 panels. Its 6 bytes a weight stream slower than the
# panels' 4, so a decode step's few rows keep the panels.
SPLIT_MIN_ROWS = 128


def split_gemm_enabled() -> bool:
    """Whether packed weights get a split-bfloat16 form: on CPUs with AMX, unless
    PYENGINE_SPLIT_GEMM=0."""
    return os.environ.get("PYENGINE_SPLIT_GEMM", "1") != "0" and _C.split_gemm_supported()


def pack_split(w_t: torch.Tensor, gate_up: bool) -> torch.Tensor | None:
    """w_t [in, out] (a weight transposed; gate_up: [gate | up]) in split-bfloat16 form,
    where enabled."""
    if not split_gemm_enabled():
        return None
    in_features, out_features = w_t.shape
    n = out_features // 2 if gate_up else out_features
    size = _C.packed_split_weight_size(in_features, n, gate_up)
    packed = host_memory.empty(size, torch.bfloat16)
    _C.pack_split_weight(packed, w_t, gate_up)
    return packed


def pack_block_quantized(blocks: BlockQuantized, gate_up: bool = False) -> torch.Tensor:
    """blocks [out, in] packed for ops.dense (gate_up: [gate; up] for dense_silu_and_mul)."""
    out_features, in_features = blocks.shape
    n = out_features // 2 if gate_up else out_features
    size = (2 if gate_up else 1) * _C.packed_quantized_weight_size(in_features, n, blocks.bits)
    packed = host_memory.empty(size, torch.uint8 if blocks.bits == 4 else torch.int8)
    q_t, scale_t, offset_t = (
        torch.from_numpy(np.ascontiguousarray(a.T)) for a in (blocks.q, blocks.scale, blocks.offset)
    )
    _C.pack_quantized_weight(packed, q_t, scale_t, offset_t, gate_up)
    return packed


class DenseWeight:
    """A [out, in] weight prepared for x [tokens, in] -> [tokens, out]. On the CPU in
    float32 it is packed once into column panels for pyengine's own matmul
    (cpp/src/kernels/dense.cpp): a decode step streams each weight byte once, in order: a
    decode step of 32 requests runs 1.2x faster than with torch.mm (which repacks the
    weight on every call), prefill about as fast (measured side by side in one process,
    SmolLM2-135M, 2 cores). A weight that came block-quantized (GGUF's Q4_0/Q4_1/Q8_0) is
    also packed in that form, for steps of few rows. Elsewhere it is the weight itself,
    for torch's matmul."""

    def __init__(
        self,
        weight: torch.Tensor,
        placement: Placement,
        blocks: BlockQuantized | None = None,
        many_rows: bool = True,
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed: torch.Tensor | None = None
        self.packed_blocks: torch.Tensor | None = None
        self.packed_split: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        if placement.packs_weights:
            size = _C.packed_weight_size(self.in_features, self.out_features)
            self.packed = host_memory.empty(size)
            w_t = weight.t().contiguous().float()
            _C.pack_weight(self.packed, w_t)
            self.packed_blocks = _packed_blocks(blocks, tuple(weight.shape), gate_up=False)
            # (The head sees a prefill's last rows only: it keeps no split form.)
            self.packed_split = pack_split(w_t, gate_up=False) if many_rows else None
        else:
            self.weight = weight.to(placement.device, placement.dtype).contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight, bias)
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        packed = _for_rows(self.packed, self.packed_blocks, self.packed_split, x)
        ops.dense(out, x, packed, bias, self.out_features)
        return out


class GatedDense:
    """silu(x @ gate) * (x @ up), an MLP's activation of its fused [gate; up] weight
    [2 * n, in]. On the CPU in float32, one op over pairs of packed panels
    (dense_silu_and_mul): the [tokens, 2 * n] product never goes to memory and back.
    Elsewhere a matmul, then silu_and_mul."""

    def __init__(
        self, weight: torch.Tensor, placement: Placement, blocks: BlockQuantized | None = None
    ) -> None:
        self.out_features, self.in_features = weight.shape[0] // 2, weight.shape[1]
        self.packed: torch.Tensor | None = None
        self.packed_blocks: torch.Tensor | None = None
        self.packed_split: torch.Tensor | None = None
        self.dense: DenseWeight | None = None
        if placement.packs_weights:
            size = 2 * _C.packed_weight_size(self.in_features, self.out_features)
            self.packed = host_memory.empty(size)
            w_t = weight.t().contiguous().float()
            _C.pack_gate_up_weight(self.packed, w_t)
            self.packed_blocks = _packed_blocks(blocks, tuple(weight.shape), gate_up=True)
            self.packed_split = pack_split(w_t, gate_up=True)
        else:
            self.dense = DenseWeight(weight, placement)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        if self.dense is not None:
            ops.silu_and_mul(out, self.dense(x))
        else:
            packed = _for_rows(self.packed, self.packed_blocks, self.packed_split, x)
            ops.dense_silu_and_mul(out, x, packed, self.out_features)
        return out


def _packed_blocks(
    blocks: BlockQuantized | None, shape: tuple[int, ...], gate_up: bool
) -> torch.Tensor | None:
    if blocks is None:
        return None
    if blocks.shape != shape:
        raise ValueError(f"block-quantized weight {blocks.shape} for a {shape} weight")
    return pack_block_quantized(blocks, gate_up)


def _for_rows(
    packed: torch.Tensor | None,
    packed_blocks: torch.Tensor | None,
    packed_split: torch.Tensor | None,
    x: torch.Tensor,
) -> torch.Tensor:
    if packed_blocks is not None and x.shape[0] <= BLOCK_QUANTIZED_MAX_ROWS:
        return packed_blocks
    if packed_split is not None and x.shape[0] >= SPLIT_MIN_ROWS:
        return packed_split
    assert packed is not None
    return packed


def prepare_dense(
    model: nn.Module,
    names: dict[str, str],
    tied_head: bool,
    placement: Placement,
    gated: frozenset[str] = frozenset(),
    block_quantized: Mapping[str, BlockQuantized] | None = None,
) -> int:
    """Replaces each named [out, in] parameter by a DenseWeight attribute (parameter name ->
    attribute name, on the same module), or a GatedDense for the names in `gated`, the head
    too (a head tied to the embeddings gets its own), then moves the remaining parameters to
    the placement. `block_quantized` gives the block form of parameters that have one
    (by parameter name). Returns the model's number of parameters (a tied head counted
    once)."""
    blocks = block_quantized or {}
    count = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    # The packed weights, streamed every step, go on huge pages (host_memory).
    with torch.no_grad(), host_memory.huge_page_arena():
        for name, attribute in names.items():
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            kind = GatedDense if name in gated else DenseWeight
            setattr(owner, attribute, kind(getattr(owner, leaf).data, placement, blocks.get(name)))
            delattr(owner, leaf)
        for parameter in model.parameters():
            parameter.data = parameter.data.to(placement.device, placement.dtype)
        # After the move: a tied head that is not packed shares the embeddings' memory.
        head_name = "embed_tokens" if tied_head else "lm_head"
        head = model.get_parameter(head_name)
        model.head = DenseWeight(  # type: ignore[assignment]
            head.data, placement, blocks.get(head_name), many_rows=False
        )
        if not tied_head:
            del model.lm_head
    return count
