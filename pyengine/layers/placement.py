"""Where a model runs and in which dtype."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Placement:
    """Float32 and bfloat16 on the CPU run pyengine's own matmul over packed weights;
    anything else runs torch's (cuBLAS on CUDA)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32

    @property
    def packs_weights(self) -> bool:
        return self.device.type == "cpu" and self.dtype == torch.float32

    @property
    def packs_bf16_weights(self) -> bool:
        """bfloat16 on the CPU runs pyengine's matmul over bfloat16 panels."""
        return self.device.type == "cpu" and self.dtype == torch.bfloat16

    @property
    def keeps_gguf_blocks(self) -> bool:
        """Whether GGUF matrices stay in block form: on the CPU in float32 (ops.dense), and
        on CUDA in 16 bits where PYENGINE_CUDA_BLOCK_GEMM=1 (ops.block_gemm: not yet run on
        a GPU, so not the default there); elsewhere they are dequantized at load."""
        cuda_blocks = (
            self.device.type == "cuda"
            and self.dtype in (torch.float16, torch.bfloat16)
            and os.environ.get("PYENGINE_CUDA_BLOCK_GEMM") == "1"
        )
        return self.packs_weights or cuda_blocks
