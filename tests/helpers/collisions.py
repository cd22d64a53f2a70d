"""Blocks whose 64-bit content hashes collide, built by inverting xxHash64's round.

A block's content hash is xxHash64 of its 16 int32 tokens (64 bytes: two 32-byte
stripes, four lanes); lane 0 reads 64-bit words 0 and 4. Choosing word 0 freely and
solving for word 4 puts lane 0 in the original state, so the whole hash, and with it
the block's key, collide. Keys are not secret: only verification (stored tokens,
parent, extras) keeps such a block from serving another prefix's KV.
"""

from __future__ import annotations

import random
import struct

MASK = (1 << 64) - 1
PRIME1 = 0x9E3779B185EBCA87
PRIME2 = 0xC2B2AE3D27D4EB4F
CONTENT_SEED = 0xB7E151628AED2A6B  # the content hash's seed (SEED_HI)


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & MASK


def _round(acc: int, word: int) -> int:
    return (_rotl((acc + word * PRIME2) & MASK, 31) * PRIME1) & MASK


def colliding_block(tokens: list[int], seed: int = 1) -> list[int]:
    """Another 16-token block (ids in [0, 2**31)) with the same content hash."""
    assert len(tokens) == 16
    words = list(struct.unpack("<8Q", struct.pack("<16i", *tokens)))
    start = (CONTENT_SEED + PRIME1 + PRIME2) & MASK
    target = _round(_round(start, words[0]), words[4])
    inverse1, inverse2 = pow(PRIME1, -1, 1 << 64), pow(PRIME2, -1, 1 << 64)
    rng = random.Random(seed)
    while True:
        word0 = rng.getrandbits(31) | (rng.getrandbits(31) << 32)  # two non-negative int32
        after0 = _round(start, word0)
        rotated = (target * inverse1) & MASK
        word4 = (((rotated >> 31) | (rotated << 33)) & MASK) - after0
        word4 = (word4 * inverse2) & MASK
        if word0 != words[0] and word4 & 0x8000_0000_8000_0000 == 0:
            words[0], words[4] = word0, word4
            return list(struct.unpack("<16i", struct.pack("<8Q", *words)))
