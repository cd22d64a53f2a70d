"""A matmul weight kept in its GGUF block form (Q4_0, Q4_1, Q8_0) beside its float32
values: the CPU matmul of a decode step then streams 0.75-1.25 bytes a weight instead of
4, and widens each block to exactly the float32 values the loader dequantizes
(cpp/include/pyengine/dense.h).

Every 32 weights along a row share a float16 scale d (and, for Q4_1, an offset m):
    Q4_0: w = d * (nibble - 8)     = nibble * d + (-8 d)
    Q4_1: w = d * nibble + m
    Q8_0: w = d * int8             = int8 * d + (-0.0)
With an 11-bit scale and an integer of at most 8 bits, q * d is exact in float32, so
q * scale + offset rounds exactly once, as the `gguf` package's float32 dequantization
does: the same float32 weights, bit for bit, but for Q4_0's zeros under a negative scale
(8 d - 8 d is +0 where d * 0 is -0). No sum tells those apart: the matmul's sums start at
+0, and adding a zero of either sign to them changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

BLOCK = 32  # weights sharing a scale (along a row)

# GGML type -> (bytes a block, bits a weight); the GGML type numbers of the gguf format.
_Q4_0, _Q4_1, _Q8_0 = 2, 3, 8
_LAYOUTS = {_Q4_0: (18, 4), _Q4_1: (20, 4), _Q8_0: (34, 8)}


@dataclass(frozen=True)
class BlockQuantized:
    """A [rows, cols] weight as q * scale + offset, a block of BLOCK columns per scale."""

    q: np.ndarray  # [rows, cols]: uint8 0..15 (4 bits) or int8 (8 bits)
    scale: np.ndarray  # float32 [rows, cols // BLOCK], float16 values
    offset: np.ndarray  # float32 [rows, cols // BLOCK]

    @property
    def bits(self) -> int:
        return 4 if self.q.dtype == np.uint8 else 8

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.q.shape
        return rows, cols

    def dequantize(self) -> np.ndarray:
        """The float32 weight (rounded as the packed kernel widens it)."""
        scale = np.repeat(self.scale, BLOCK, axis=1)
        offset = np.repeat(self.offset, BLOCK, axis=1)
        weight: np.ndarray = (self.q.astype(np.float32) * scale + offset).astype(np.float32)
        return weight

    def map_rows(self, reorder: Callable[[np.ndarray], np.ndarray]) -> BlockQuantized:
        """The same row reordering applied to q, scale and offset (llama.cpp's q/k rows)."""
        return BlockQuantized(reorder(self.q), reorder(self.scale), reorder(self.offset))

    def rows(self, start: int, stop: int) -> BlockQuantized:
        """Rows [start, stop) (a tensor-parallel shard of the output features)."""
        return BlockQuantized(self.q[start:stop], self.scale[start:stop], self.offset[start:stop])

    def columns(self, start: int, stop: int) -> BlockQuantized:
        """Columns [start, stop), whole blocks only (a shard of the input features)."""
        if start % BLOCK or stop % BLOCK:
            raise ValueError(
                f"columns [{start}, {stop}) of a block-quantized weight split its blocks of {BLOCK}"
            )
        blocks = slice(start // BLOCK, stop // BLOCK)
        return BlockQuantized(self.q[:, start:stop], self.scale[:, blocks], self.offset[:, blocks])

    def with_bits(self, bits: int) -> BlockQuantized:
        """As 8-bit (int8 holds every 4-bit value); 4 bits only from 4 bits."""
        if bits == self.bits:
            return self
        if bits != 8:
            raise ValueError(f"an {self.bits}-bit weight does not fit in {bits} bits")
        return BlockQuantized(self.q.astype(np.int8), self.scale, self.offset)

    @staticmethod
    def stack(parts: Sequence[BlockQuantized]) -> BlockQuantized:
        """Rows of each part after the last's (a fused q/k/v or gate/up weight); 8-bit if
        any part is."""
        bits = max(p.bits for p in parts)
        parts = [p.with_bits(bits) for p in parts]
        return BlockQuantized(
            np.concatenate([p.q for p in parts]),
            np.concatenate([p.scale for p in parts]),
            np.concatenate([p.offset for p in parts]),
        )


def is_block_quantized(ggml_type: int) -> bool:
    return ggml_type in _LAYOUTS


def from_gguf_blocks(raw: np.ndarray, ggml_type: int) -> BlockQuantized:
    """raw: uint8 [rows, row bytes] of a Q4_0, Q4_1 or Q8_0 tensor."""
    block_bytes, _ = _LAYOUTS[ggml_type]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, block_bytes)
    scale = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if ggml_type == _Q8_0:
        q = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
        return BlockQuantized(q, scale, np.full_like(scale, -0.0))
    if ggml_type == _Q4_1:
        offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = blocks[..., 4:]
    else:
        offset = -8 * scale
        packed = blocks[..., 2:]
    # A block's 16 bytes hold weights 0-15 in their low nibbles, 16-31 in the high ones.
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    return BlockQuantized(q, scale, offset)
