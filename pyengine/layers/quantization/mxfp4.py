"""The `mxfp4` quant_method: gpt-oss's released checkpoints, whose experts alone are
MXFP4 (the OCP microscaling form): every 32 weights along a row share a power-of-two
scale (an e8m0 byte, 2^(s - 127)), each weight an e2m1 code (a nibble: sign, two
exponent bits, one mantissa bit; 0, 0.5, 1, 1.5, 2, 3, 4 or 6), two a byte, the even
weight in the low nibble. A layer's experts come as `<proj>_blocks` [experts, rows,
cols / 32, 16] uint8 and `<proj>_scales` [experts, rows, cols / 32] uint8; everything
else in such a checkpoint is float.

Twice an e2m1 value is an integer in -12..12, so a block is exactly an 8-bit block of
pyengine's form (layers/block_quantized.py): q = 2 e2m1 as int8, scale = 2^(s - 128),
no offset. On the CPU in float32 the experts stay in that form (1.125 bytes a weight,
ops.fused_experts widening them in registers to the values transformers dequantizes);
elsewhere they are dequantized at load. The linear layers are float (dense_method)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pyengine.config import QuantizationConfig
from pyengine.layers.block_quantized import BLOCK, TWICE_E2M1, BlockQuantized, half_e8m0
from pyengine.layers.placement import Placement
from pyengine.layers.quantization.base import LinearMethod, QuantizationMethod
from pyengine.layers.quantization.registry import register_quantization
from pyengine.layers.quantization.unquantized import dense_method


@register_quantization("mxfp4")
class Mxfp4(QuantizationMethod):
    def from_hf(self, raw: dict[str, Any]) -> QuantizationConfig:
        # (modules_to_not_convert names the float layers: all but the experts, always)
        return QuantizationConfig("mxfp4", 4, BLOCK, weight_type="float")

    def check(self, config: QuantizationConfig) -> None:
        if (config.bits, config.group_size, config.weight_type) != (4, BLOCK, "float"):
            raise ValueError(
                f"mxfp4 holds e2m1 weights in blocks of {BLOCK}, not {config.bits}-bit "
                f"{config.weight_type} ones in groups of {config.group_size}"
            )

    def linear_method(
        self, config: QuantizationConfig, placement: Placement, int8_activations: bool
    ) -> LinearMethod:
        """(the checkpoint's linear layers are float: only its experts are MXFP4)"""
        return dense_method(placement, many_rows=True)


def mxfp4_blocks(blocks: np.ndarray, scales: np.ndarray) -> BlockQuantized:
    """One weight's MXFP4 form (blocks [rows, cols / 32, 16] uint8, scales [rows, cols / 32]
    uint8) as 8-bit blocks of the same values."""
    rows, groups, half = blocks.shape
    if half != BLOCK // 2 or scales.shape != (rows, groups):
        raise ValueError(
            f"MXFP4 blocks [rows, cols / {BLOCK}, {BLOCK // 2}] with scales [rows, cols / "
            f"{BLOCK}], got {tuple(blocks.shape)} and {tuple(scales.shape)}"
        )
    q = np.empty((rows, groups, BLOCK), np.int8)
    q[..., 0::2] = TWICE_E2M1[blocks & 0x0F]
    q[..., 1::2] = TWICE_E2M1[blocks >> 4]
    scale = half_e8m0(scales)
    return BlockQuantized(q.reshape(rows, groups * BLOCK), scale, np.full_like(scale, -0.0))


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., rows, cols / 32, 16] blocks and [..., rows, cols / 32] scales (uint8) as the
    float32 weights [..., rows, cols] (each matrix through mxfp4_blocks)."""
    rows, groups, half = blocks.shape[-3:]
    matrices = zip(blocks.reshape(-1, rows, groups, half).numpy(),
                   scales.reshape(-1, rows, groups).numpy(), strict=True)  # fmt: skip
    weights = np.stack([mxfp4_blocks(b, s).dequantize() for b, s in matrices])
    return torch.from_numpy(weights).reshape(*blocks.shape[:-2], groups * half * 2)
