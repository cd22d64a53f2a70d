"""Q4_K, Q5_K and Q6_K blocks of a float matrix, written by the layout llama.cpp
documents (ggml-common.h), for tests: the `gguf` package reads them but cannot write them.

A block holds 256 weights of a row in 8 groups of 32: float16 d and dmin, then 12 bytes
of 6-bit (scale, min) pairs, w = d * sc * q - dmin * mn. Bytes 0-3 hold groups 0-3's sc
in their low 6 bits, bytes 4-7 their mn; groups 4-7 keep their low 4 bits in bytes 8-11
(sc low, mn high) and their top 2 in the top bits of bytes 0-3 (sc) and 4-7 (mn). Q4_K's
128 bytes of q: 4 runs of 32 bytes, each 32 groups' worth of low nibbles (group 2r) then
high nibbles (group 2r + 1). Q5_K adds 32 bytes of fifth bits before them: bit g of byte
l is the fifth bit of weight l of group g.

A Q6_K block holds 256 weights in 16 groups of 16, w = d * sc * (q - 32), q 6-bit: 128
bytes of low nibbles, 64 of high bit pairs, 16 int8 sc, then float16 d. In each half of
128 weights, weight l (l < 32) is the low nibble of byte l, l + 32 that of byte l + 32,
l + 64 and l + 96 their high nibbles; pair byte l holds their top bits, 2 each, in that
order from the lowest.
"""

from __future__ import annotations

import numpy as np


def _scales_and_mins(w: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """w [blocks, 8, 32] -> d, dmin [blocks] (float16), sc, mn [blocks, 8] (0..63),
    q [blocks, 8, 32] (0..levels)."""
    low = np.minimum(w.min(axis=-1), 0.0)  # a group's offset is -mn * dmin <= 0
    step = (w.max(axis=-1) - low) / levels
    d = (step.max(axis=-1) / 63).astype(np.float16)
    dmin = (-low.min(axis=-1) / 63).astype(np.float16)
    safe = lambda v: np.where(v == 0, 1, v.astype(np.float32))  # noqa: E731
    sc = np.clip(np.rint(step / safe(d)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low / safe(dmin)[:, None]), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.rint((w + offset[..., None]) / np.where(scale == 0, 1, scale)[..., None])
    return d, dmin, sc, mn, np.clip(q, 0, levels).astype(np.uint8)


def _packed_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


def _nibble_runs(q: np.ndarray) -> np.ndarray:
    """q [blocks, 8, 32] (low 4 bits used) -> the 128 bytes of each block."""
    pairs = (q & 15).reshape(q.shape[0], 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(q.shape[0], 128)


def quantize_k(w: np.ndarray, bits: int) -> np.ndarray:
    """w float32 [rows, cols] (cols a multiple of 256) -> uint8 [rows, cols / 256 * size],
    Q4_K (bits 4, 144 bytes a block) or Q5_K (bits 5, 176)."""
    rows, cols = w.shape
    groups = w.astype(np.float32).reshape(-1, 8, 32)
    d, dmin, sc, mn, q = _scales_and_mins(groups, (1 << bits) - 1)
    parts = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2)]
    parts.append(_packed_scales(sc, mn))
    if bits == 5:
        fifth = (q >> 4) & 1  # [blocks, 8, 32]
        parts.append(
            (fifth << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)
        )
    parts.append(_nibble_runs(q))
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """w float32 [rows, cols] (cols a multiple of 256) -> uint8 [rows, cols / 256 * 210]."""
    rows, cols = w.shape
    groups = w.astype(np.float32).reshape(-1, 16, 16)  # [blocks, group, weight]
    step = np.abs(groups).max(axis=-1) / 31  # q - 32 in [-31, 31]
    d = (step.max(axis=-1) / 127).astype(np.float16)
    safe = lambda v: np.where(v == 0, 1, v.astype(np.float32))  # noqa: E731
    sc = np.clip(np.rint(step / safe(d)[:, None]), -128, 127).astype(np.int8)
    scale = d.astype(np.float32)[:, None] * sc
    q = np.clip(np.rint(groups / safe(scale)[..., None]) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # [blocks, half, quarter, l]
    low = q & 15
    nibbles = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=-1
    )  # [blocks, half, 64]
    pairs = sum((q[:, :, i] >> 4) << (2 * i) for i in range(4)).astype(np.uint8)
    parts = [nibbles.reshape(-1, 128), pairs.reshape(-1, 64), sc.view(np.uint8),
             d.view(np.uint8).reshape(-1, 2)]  # fmt: skip
    return np.concatenate(parts, axis=1).reshape(rows, -1)
