"""GGUF block-quantized matrices on CUDA (PYENGINE_CUDA_BLOCK_GEMM=1, gguf.py), and
GPTQ/AWQ/W4A16 ones whose groups hold whole blocks (weight_only_int.py): held as their
integers (0.5 or 1 byte a weight, reordered at load for the kernel's warps) with a
float32 scale and offset per group, and multiplied by ops.block_gemm, which widens each
weight in registers to the 16-bit type (exactly the weight a dequantization at load
gives) for the tensor cores. Off by default until bench/gpu/run.sh has run it on a GPU:
otherwise the blocks are dequantized at load (TorchLinearMethod)."""

from __future__ import annotations

import torch

from pyengine import _C, ops
from pyengine.layers.block_quantized import BlockQuantized


class CudaBlockForm:
    """A [n, k] weight's block form on the device, as ops.block_gemm takes it."""

    def __init__(self, blocks: BlockQuantized, device: torch.device) -> None:
        n, k = blocks.shape
        self.bits, self.group = blocks.bits, blocks.group
        q = torch.from_numpy(blocks.q).contiguous()
        packed = torch.empty(_C.packed_block_gemm_size(k, n, self.bits), dtype=torch.uint8)
        _C.pack_block_gemm_weight(packed, q, self.bits)
        self.packed = packed.to(device)
        self.scale = torch.from_numpy(blocks.scale).float().contiguous().to(device)
        self.offset = torch.from_numpy(blocks.offset).float().contiguous().to(device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scale, self.offset]

    def describe(self) -> str:
        return f"{self.bits}-bit CUDA blocks"


def cuda_block_product(
    form: CudaBlockForm, x: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """x [tokens, k] @ the form's weight.T + bias -> [tokens, n], in x's dtype."""
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    ops.block_gemm(out, x, form.packed, form.scale, form.offset,
                   None if bias is None else bias.float(), form.bits, form.group)  # fmt: skip
    return out
