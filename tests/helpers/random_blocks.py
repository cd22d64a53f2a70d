"""Fresh random GGUF-style blocks (BlockQuantized), for the tests of the kernels that
multiply them."""

from __future__ import annotations

import torch

from pyengine.layers.block_quantized import BLOCK, BlockQuantized


def random_blocks(rows: int, cols: int, bits: int, form: str) -> BlockQuantized:
    """Fresh random blocks: float16 scales; offsets as Q4_1 (float16), Q4_0 (-8 scale) or
    Q8_0 (-0.0) store them; Q6_K's: a float16 times an int8 per 16 weights, no offset."""
    if form == "q6_k":
        d = (torch.rand(rows, 1) * 0.01).half().float()
        scale = d * torch.randint(-128, 128, (rows, cols // 16)).float()
        q = torch.randint(-32, 32, (rows, cols), dtype=torch.int8)
        return BlockQuantized(q.numpy(), scale.numpy(), torch.full_like(scale, -0.0).numpy())
    scale = (torch.randn(rows, cols // BLOCK) * 0.05).half().float()
    if bits == 4:
        q = torch.randint(0, 16, (rows, cols), dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (rows, cols), dtype=torch.int8)
    offset = {
        "q4_1": (torch.randn(rows, cols // BLOCK) * 0.1).half().float(),
        "q4_0": -8 * scale,
        "q8_0": torch.full_like(scale, -0.0),
    }[form]
    return BlockQuantized(q.numpy(), scale.numpy(), offset.numpy())
