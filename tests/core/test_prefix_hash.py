"""Prefix keys against an independent reference: the xxhash package (the C library by
xxHash's author) composing the documented chain in Python: a block's content hash is
xxh64(its int32 token ids, SEED_HI); its key is (xxh64(record, SEED_HI),
xxh64(record, SEED_LO)) of the record (parent key, content hash, extras digest)."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import xxhash

from pyengine import _C, compute_block_keys
from pyengine import xxhash64 as native_xxhash64

SEED_HI = 0xB7E151628AED2A6B
SEED_LO = 0x7E5E2F0E5C1A3D51
ROOT = (0x243F6A8885A308D3, 0x13198A2E03707344)


def lanes(data: bytes) -> tuple[int, int]:
    return xxhash.xxh64_intdigest(data, SEED_HI), xxhash.xxh64_intdigest(data, SEED_LO)


def reference_keys(tokens: np.ndarray, block_size: int, adapter_id: int, salt: str) -> np.ndarray:
    salt_bytes = salt.encode()
    extras = xxhash.xxh64_intdigest(
        struct.pack(
            "<3Q", adapter_id % 2**64, xxhash.xxh64_intdigest(salt_bytes, SEED_LO), len(salt_bytes)
        ),
        SEED_HI,
    )
    parent = ROOT
    keys = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size].astype("<i4").tobytes()
        content = xxhash.xxh64_intdigest(block, SEED_HI)
        parent = lanes(struct.pack("<4Q", *parent, content, extras))
        keys.append(parent)
    return np.array(keys, dtype=np.uint64).reshape(-1, 2)


@pytest.mark.parametrize("length", [0, 1, 3, 4, 7, 8, 31, 32, 33, 64, 100, 1000])
def test_xxhash64_matches_the_reference_library(length: int) -> None:
    rng = np.random.default_rng()
    data = os.urandom(length)
    seed = int(rng.integers(0, 2**63))
    assert native_xxhash64(data, seed) == xxhash.xxh64_intdigest(data, seed)


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "adapter_id", "salt"),
    [
        (0, 16, 0, ""),
        (15, 16, 0, ""),
        (100, 16, 0, ""),
        (37, 1, 3, "tenant"),
        (32 * 1024 + 5, 16, 0, "x"),
        (5000, 64, -1, "séance"),
        (8192 * 16 + 3, 16, 0, ""),  # enough blocks for the parallel (OpenMP) path
    ],
)
def test_block_keys_match_the_reference_chain(
    num_tokens: int, block_size: int, adapter_id: int, salt: str
) -> None:
    tokens = np.random.default_rng().integers(0, 150_000, num_tokens, dtype=np.int32)
    keys = compute_block_keys(tokens, block_size, adapter_id=adapter_id, cache_salt=salt)
    assert keys.dtype == np.uint64 and keys.shape == (num_tokens // block_size, 2)
    np.testing.assert_array_equal(keys, reference_keys(tokens, block_size, adapter_id, salt))


def test_keys_from_lists_and_arrays_agree() -> None:
    tokens = list(range(50))
    np.testing.assert_array_equal(
        compute_block_keys(tokens, 16), compute_block_keys(np.array(tokens, dtype=np.int64), 16)
    )


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="power of two"):
        compute_block_keys([1, 2, 3], 6)
    with pytest.raises(ValueError, match="outside"):
        compute_block_keys([1, -2, 3], 1)
    with pytest.raises(ValueError, match="integer dtype"):
        compute_block_keys(np.ones(4), 2)


@pytest.mark.parametrize(("num_tokens", "block_size"), [(0, 16), (15, 16), (1000, 16), (77, 1)])
def test_block_content_hashes_are_the_chains_first_level(num_tokens: int, block_size: int) -> None:
    tokens = np.random.default_rng().integers(0, 150_000, num_tokens, dtype=np.int32)
    out = np.zeros(num_tokens // block_size, dtype=np.int64)
    _C.block_content_hashes(tokens, block_size, out)
    want = [
        xxhash.xxh64_intdigest(tokens[b * block_size : (b + 1) * block_size].tobytes(), SEED_HI)
        for b in range(num_tokens // block_size)
    ]
    assert out.view(np.uint64).tolist() == want
    with pytest.raises(ValueError, match=r"out must be dense int64 \["):
        _C.block_content_hashes(tokens, block_size, np.zeros(len(out) + 1, dtype=np.int64))
    with pytest.raises(ValueError, match="tokens must be dense int32"):
        _C.block_content_hashes(tokens.astype(np.int64), block_size, out)
