"""A matmul weight kept in a GGUF block form: the CPU matmul streams its 0.625-0.75
(4-bit) or 1.0625-1.5 (8-bit) bytes a weight instead of float32's 4, and widens each
block to exactly the float32 values the `gguf` package dequantizes
(cpp/include/pyengine/dense.h).

Every 32 weights along a row share a scale and offset, w = q * scale + offset (packed in
float16 where every one is a float16, as the legacy types' are):
    Q4_0: w = d * (nibble - 8)     = nibble * d + (-8 d)
    Q4_1: w = d * nibble + m
    Q5_0: w = d * (q5 - 16)        = int8 * d + (-0.0)        (as 8-bit)
    Q5_1: w = d * q5 + m                                       (as 8-bit)
    Q8_0: w = d * int8             = int8 * d + (-0.0)
    Q4_K: w = (d * sc) * nibble - dmin * mn, sc and mn 6-bit, one pair per 32 of the 256
    Q5_K: the same with 5-bit q                                (as 8-bit)
    Q6_K: w = (d * sc) * (q6 - 32), sc an int8 per 16 weights  (as 8-bit, groups of 16)
    Q3_K: w = (d * sc) * q3, q3 in -4..3, sc 6-bit less 32     (as 8-bit, groups of 16)
    Q2_K: w = (d * sc) * q2 - dmin * m, sc and m 4-bit         (as 8-bit, groups of 16)
    MXFP4: w = 2^(e - 127) * e2m1   = (2 e2m1) * 2^(e - 128)    (as 8-bit)
With d a float16 (11 significant bits) times an integer of at most 6 bits, a scale has at
most 17, and q * scale is exact in float32 (q of 4 bits, or 5 bits in an int8), so
q * scale + offset rounds exactly once, as the `gguf` package's float32 dequantization
does (Q6_K has no offset: its d * sc, 18 bits, times q rounds once either way): the same
float32 weights, bit for bit, but for the zeros of a negative scale (8 d - 8 d is +0
where d * 0 is -0). No sum tells those apart: the matmul's sums start at +0, and adding
a zero of either sign to them changes nothing. (The 2- and 3-bit K-quants take 1.5 bytes
a weight here against their 0.33 and 0.43 in the file: a fifth of float32's still.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

BLOCK = 32  # weights of a block (along a row): the matmul's unit of k
HALF_BLOCK = 16  # an 8-bit block's groups may be its halves (Q6_K's)

# The GGML type numbers of the gguf format.
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0 = 2, 3, 6, 7, 8
_Q2_K, _Q3_K, _Q4_K, _Q5_K, _Q6_K = 10, 11, 12, 13, 14
_MXFP4 = 39

# MXFP4's e2m1 codes (a nibble: sign, two exponent bits, one mantissa bit) at twice their
# value (0, 0.5, 1, 1.5, 2, 3, 4, 6): integers in -12..12, an 8-bit block's q, the scale
# halved to match.
TWICE_E2M1 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def half_e8m0(exponents: np.ndarray) -> np.ndarray:
    """MXFP4's scale bytes (e8m0: 2^(e - 127)) halved, float32: the scale of twice the
    e2m1 values."""
    scale: np.ndarray = np.ldexp(np.float32(1), exponents.astype(np.int32) - 128)
    return scale.astype(np.float32)


@dataclass(frozen=True)
class BlockQuantized:
    """A [rows, cols] weight as q * scale + offset, a group of `group` columns (a block of
    BLOCK, or, 8-bit, its halves) per scale."""

    q: np.ndarray  # [rows, cols]: uint8 0..15 (4 bits) or int8 (8 bits)
    scale: np.ndarray  # float32 [rows, cols // group], float16 values
    offset: np.ndarray  # float32 [rows, cols // group]

    @property
    def bits(self) -> int:
        return 4 if self.q.dtype == np.uint8 else 8

    @property
    def group(self) -> int:
        return int(self.q.shape[1] // max(self.scale.shape[1], 1)) if self.q.shape[1] else BLOCK

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.q.shape
        return rows, cols

    def dequantize(self) -> np.ndarray:
        """The float32 weight (rounded as the packed kernel widens it)."""
        scale = np.repeat(self.scale, self.group, axis=1)
        offset = np.repeat(self.offset, self.group, axis=1)
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
        groups = slice(start // self.group, stop // self.group)
        return BlockQuantized(self.q[:, start:stop], self.scale[:, groups], self.offset[:, groups])

    def with_bits(self, bits: int) -> BlockQuantized:
        """As 8-bit (int8 holds every 4-bit value); 4 bits only from 4 bits."""
        if bits == self.bits:
            return self
        if bits != 8:
            raise ValueError(f"an {self.bits}-bit weight does not fit in {bits} bits")
        return BlockQuantized(self.q.astype(np.int8), self.scale, self.offset)

    def with_group(self, group: int) -> BlockQuantized:
        """In groups of `group` (a divisor of its own): each scale and offset repeated."""
        if group == self.group:
            return self
        times = self.group // group
        return BlockQuantized(
            self.q, np.repeat(self.scale, times, axis=1), np.repeat(self.offset, times, axis=1)
        )

    @staticmethod
    def stack(parts: Sequence[BlockQuantized]) -> BlockQuantized:
        """Rows of each part after the last's (a fused q/k/v or gate/up weight); 8-bit if
        any part is, in the smallest groups of any."""
        bits = max(p.bits for p in parts)
        group = min(p.group for p in parts)
        parts = [p.with_bits(bits).with_group(group) for p in parts]
        return BlockQuantized(
            np.concatenate([p.q for p in parts]),
            np.concatenate([p.scale for p in parts]),
            np.concatenate([p.offset for p in parts]),
        )


Parts = tuple[np.ndarray, np.ndarray, np.ndarray]  # q, scale, offset of [rows, blocks, bytes]


@dataclass(frozen=True)
class _Layout:
    weights: int  # a GGUF block's
    bytes: int
    decode: Callable[[np.ndarray], Parts]  # -> q [rows, weights], scale/offset [rows, groups]


def _float16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes as float32 [...]."""
    values: np.ndarray = raw.copy().view(np.float16)[..., 0].astype(np.float32)
    return values


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 16] bytes holding weights 0-15 in their low nibbles, 16-31 in the high ones."""
    # (written in place: half the time of a concatenation of the two halves)
    out = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]), np.uint8)
    half = packed.shape[-1]
    np.bitwise_and(packed, 0x0F, out=out[..., :half])
    np.right_shift(packed, 4, out=out[..., half:])
    return out


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes of fifth bits, as [..., 32] (weight j at bit j)."""
    word = qh.copy().view(np.uint32)  # [..., 1], little-endian
    bits: np.ndarray = ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return bits


def _q4_0(blocks: np.ndarray) -> Parts:
    d = _float16(blocks[..., :2])
    return _nibbles(blocks[..., 2:]), d, -8 * d


def _q4_1(blocks: np.ndarray) -> Parts:
    return _nibbles(blocks[..., 4:]), _float16(blocks[..., :2]), _float16(blocks[..., 2:4])


def _q5_0(blocks: np.ndarray) -> Parts:
    q = (_nibbles(blocks[..., 6:]) | (_high_bits(blocks[..., 2:6]) << 4)).astype(np.int8) - 16
    d = _float16(blocks[..., :2])
    return q.astype(np.int8), d, np.full_like(d, -0.0)


def _q5_1(blocks: np.ndarray) -> Parts:
    q = _nibbles(blocks[..., 8:]) | (_high_bits(blocks[..., 4:8]) << 4)
    return q.view(np.int8), _float16(blocks[..., :2]), _float16(blocks[..., 2:4])


def _q8_0(blocks: np.ndarray) -> Parts:
    d = _float16(blocks[..., :2])
    return blocks[..., 2:].copy().view(np.int8), d, np.full_like(d, -0.0)


def _mxfp4(blocks: np.ndarray) -> Parts:
    """llama.cpp's MXFP4 (gpt-oss's): an e8m0 scale byte (2^(e - 127)), then 16 bytes of
    codes, the first 16 weights' in the low nibbles and the last 16's in the high ones: as
    8 bits, q = twice the e2m1 value and scale 2^(e - 128)."""
    codes = blocks[..., 1:]
    q = np.concatenate((TWICE_E2M1[codes & 0x0F], TWICE_E2M1[codes >> 4]), axis=-1)
    scale = half_e8m0(blocks[..., 0])
    return q, scale, np.full_like(scale, -0.0)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant block's 8 (scale, offset) pairs, d * sc and -(dmin * mn), [..., 8]: the
    6-bit sc and mn of groups 0-3 are the low bits of bytes 0-3 and 4-7; those of groups
    4-7 take their low 4 bits from bytes 8-11 and their high 2 from the top of bytes 0-7."""
    d, dmin = _float16(blocks[..., 0:2]), _float16(blocks[..., 2:4])
    packed = blocks[..., 4:16]
    low, high, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low & 63, (rest & 15) | ((low >> 6) << 4)], axis=-1)
    mn = np.concatenate([high & 63, (rest >> 4) | ((high >> 6) << 4)], axis=-1)
    return d[..., None] * sc.astype(np.float32), -(dmin[..., None] * mn.astype(np.float32))


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes as 256 4-bit values: 4 runs of 32 bytes, each 32 low nibbles, then 32
    high ones."""
    runs = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([runs & 0x0F, runs >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _q4_k(blocks: np.ndarray) -> Parts:
    scale, offset = _k_scales(blocks)
    return _k_low_nibbles(blocks[..., 16:144]), scale, offset


def _q6_k(blocks: np.ndarray) -> Parts:
    """128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, float16 d. Each
    half of 128 weights takes 64 nibble bytes and 32 pair bytes: weights l, l + 32, l + 64
    and l + 96 (l < 32) are byte l's low nibble, byte l + 32's low, byte l's high, byte
    l + 32's high, with bit pairs 0, 1, 2, 3 of pair byte l on top."""
    halves = []
    for h in range(2):
        low = blocks[..., 64 * h : 64 * h + 64]
        pairs = blocks[..., 128 + 32 * h : 160 + 32 * h]
        nibbles = (low[..., :32] & 15, low[..., 32:] & 15, low[..., :32] >> 4, low[..., 32:] >> 4)
        halves += [n | (((pairs >> (2 * i)) & 3) << 4) for i, n in enumerate(nibbles)]
    q = np.concatenate(halves, axis=-1).astype(np.int8) - 32
    d = _float16(blocks[..., 208:210])
    scale = d[..., None] * blocks[..., 192:208].view(np.int8).astype(np.float32)
    return q.astype(np.int8), scale, np.full_like(scale, -0.0)


def _k_crumbs(qs: np.ndarray) -> np.ndarray:
    """64 bytes as 256 2-bit values: 2 runs of 32 bytes, each 4 times its bytes' bit
    pairs 0, 1, 2, 3 (weight 128 c + 32 s + l: pair s of byte 32 c + l)."""
    runs = qs.reshape(*qs.shape[:-1], 2, 1, 32)
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    crumbs: np.ndarray = ((runs >> shifts) & 3).reshape(*qs.shape[:-1], 256)
    return crumbs


def _q2_k(blocks: np.ndarray) -> Parts:
    """16 bytes of (4-bit scale, 4-bit min) per 16 weights, 64 of 2-bit q, float16 d and
    dmin: w = (d * sc) * q - dmin * m (as 8-bit, groups of 16)."""
    sc, mn = blocks[..., :16] & 15, blocks[..., :16] >> 4
    d, dmin = _float16(blocks[..., 80:82]), _float16(blocks[..., 82:84])
    scale = d[..., None] * sc.astype(np.float32)
    offset = -(dmin[..., None] * mn.astype(np.float32))
    return _k_crumbs(blocks[..., 16:80]).astype(np.int8), scale, offset


def _q3_k(blocks: np.ndarray) -> Parts:
    """32 bytes of high bits (weight i: bit i // 32 of byte i % 32; a clear bit takes 4
    off), 64 of low 2-bit q, 12 of 6-bit scales (scale j: the low or high nibble of byte
    j % 8, j < 8 or not, with bit pair j // 4 of byte 8 + j % 4 on top; less 32), float16
    d: w = (d * sc) * q, q in -4..3 (as 8-bit, groups of 16)."""
    high = blocks[..., :32]
    bits = (high[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [..., 8, 32]
    cleared = 1 - bits.reshape(*high.shape[:-1], 256).astype(np.int8)
    q = _k_crumbs(blocks[..., 32:96]).astype(np.int8) - 4 * cleared
    packed = blocks[..., 96:108]
    low = np.concatenate([packed[..., :8] & 15, packed[..., :8] >> 4], axis=-1)
    pairs = (packed[..., 8:12, None] >> (2 * np.arange(4, dtype=np.uint8))) & 3  # [..., 4, 4]
    top = np.swapaxes(pairs, -1, -2).reshape(*packed.shape[:-1], 16)  # j = 4 (j // 4) + j % 4
    sc = (low | (top << 4)).astype(np.int8) - 32
    scale = _float16(blocks[..., 108:110])[..., None] * sc.astype(np.float32)
    return q.astype(np.int8), scale, np.full_like(scale, -0.0)


def _q5_k(blocks: np.ndarray) -> Parts:
    scale, offset = _k_scales(blocks)
    qh = blocks[..., 16:48]  # group g's fifth bits: bit g of each of the 32 bytes
    fifth = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [..., 8, 32]
    q = _k_low_nibbles(blocks[..., 48:176]) | (fifth.reshape(*qh.shape[:-1], 256) << 4)
    return q.view(np.int8), scale, offset


_LAYOUTS = {
    _Q4_0: _Layout(32, 18, _q4_0), _Q4_1: _Layout(32, 20, _q4_1),
    _Q5_0: _Layout(32, 22, _q5_0), _Q5_1: _Layout(32, 24, _q5_1),
    _Q8_0: _Layout(32, 34, _q8_0),
    _Q2_K: _Layout(256, 84, _q2_k), _Q3_K: _Layout(256, 110, _q3_k),
    _Q4_K: _Layout(256, 144, _q4_k), _Q5_K: _Layout(256, 176, _q5_k),
    _Q6_K: _Layout(256, 210, _q6_k),
    _MXFP4: _Layout(32, 17, _mxfp4),
}  # fmt: skip


def is_block_quantized(ggml_type: int) -> bool:
    return ggml_type in _LAYOUTS


def from_gguf_blocks(raw: np.ndarray, ggml_type: int) -> BlockQuantized:
    """raw: uint8 [rows, row bytes] of a tensor of one of the types above."""
    layout = _LAYOUTS[ggml_type]
    rows = raw.shape[0]
    q, scale, offset = layout.decode(raw.reshape(rows, -1, layout.bytes))
    return BlockQuantized(
        np.ascontiguousarray(q.reshape(rows, -1)),
        np.ascontiguousarray(scale.reshape(rows, -1), dtype=np.float32),
        np.ascontiguousarray(offset.reshape(rows, -1), dtype=np.float32),
    )
