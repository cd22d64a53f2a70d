"""The packed forms of a weight that pyengine's CPU matmul (ops.dense, cpp/src/kernels/
dense.cpp) multiplies from, each made once at load from the weight transposed: float32,
bfloat16 and split-bfloat16 panels, and quantized panels (GGUF blocks, fp8 codes). The
methods that hold them (unquantized.py, gguf.py, weight_only_int.py, fp8_w8a8.py) and the
vocabulary embedding (its GGUF blocks) share these."""

from __future__ import annotations

import torch

from pyengine import _C
from pyengine.layers.block_quantized import BlockQuantized
from pyengine.utils import host_memory


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
    # (torch's transposing copy: 7x numpy's on a byte per weight, most of a GGUF's load)
    q_t, scale_t, offset_t = (
        torch.from_numpy(a if a.flags.writeable else a.copy()).t().contiguous()
        for a in (blocks.q, blocks.scale, blocks.offset)
    )
    return pack_quantized(q_t, scale_t, offset_t, gate_up)


def blocks_form(packed: torch.Tensor) -> str:
    """How packed quantized panels are named in words: "4-bit blocks", "fp8 blocks"."""
    bits = {torch.uint8: "4-bit", torch.int8: "8-bit", torch.float8_e4m3fn: "fp8"}
    return f"{bits[packed.dtype]} blocks"
