"""Checks and copies of a checkpoint tensor into a layer's shard, shared by the linear
layers (layers/linear.py), the vocabulary layers and the quantization methods that load
tensors of their own."""

from __future__ import annotations

import torch

from pyengine.layers.block_quantized import BlockQuantized
from pyengine.utils.lazy_weights import CheckpointTensor, materialize


def check_shape(
    name: str, loaded: CheckpointTensor | BlockQuantized, expected: tuple[int, ...]
) -> None:
    """ValueError naming checkpoint tensor `name` where its shape is not `expected`."""
    if tuple(loaded.shape) != expected:
        raise ValueError(f"weight {name}: shape {tuple(loaded.shape)}, model expects {expected}")


def copy_checked(name: str, into: torch.Tensor, value: CheckpointTensor) -> None:
    """Checks the shape, then reads `value` (only its region, where it is a LazySlice);
    integers go only into integers (an int8 checkpoint's weight), fp8 only into fp8 (an
    FP8 checkpoint's, which means nothing without its scale), never cast."""
    check_shape(name, value, tuple(into.shape))
    tensor = materialize(value)
    fp8 = torch.float8_e4m3fn
    if (into.dtype.is_floating_point != tensor.dtype.is_floating_point) or (
        (into.dtype == fp8) != (tensor.dtype == fp8)
    ):
        raise ValueError(f"weight {name}: {tensor.dtype} values, the model expects {into.dtype}")
    into.copy_(tensor)
