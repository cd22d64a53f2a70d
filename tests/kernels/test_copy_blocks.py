"""copy_blocks on the CPU against a numpy reference, through DLPack (numpy, and torch
when installed)."""

from __future__ import annotations

import numpy as np
import pytest

from pyengine import built_with_cuda, copy_blocks, swap_blocks


def reference(caches: list[np.ndarray], mapping: np.ndarray) -> list[np.ndarray]:
    out = [c.copy() for c in caches]
    for src, dst in mapping:
        for c in out:
            c[dst] = c[src]
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8, np.int64])
def test_copies_blocks_of_every_cache(dtype: type) -> None:
    rng = np.random.default_rng()
    num_blocks, block_shape = 12, (16, 2, 8)  # [num_blocks, block_size, num_kv_heads, head_size]
    caches = [
        (rng.standard_normal((num_blocks, *block_shape)) * 50).astype(dtype) for _ in range(4)
    ]
    mapping = np.stack([rng.permutation(num_blocks)[:5], rng.permutation(num_blocks)[:5]], axis=1)
    mapping = mapping[mapping[:, 0] != mapping[:, 1]]
    mapping = mapping[np.unique(mapping[:, 1], return_index=True)[1]]  # one writer per block
    mapping = mapping[~np.isin(mapping[:, 0], mapping[:, 1])]  # sources not overwritten
    expected = reference(caches, mapping)
    copy_blocks(caches, mapping)
    for got, want in zip(caches, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_view_with_padded_blocks() -> None:
    storage = np.arange(6 * 10, dtype=np.float32).reshape(6, 10)
    cache = storage[:, :8]  # blocks 8 floats apart in a row of 10: stride[0] != block size
    with pytest.raises(ValueError, match="dense dims after the first"):
        copy_blocks([cache.reshape(6, 2, 4)[:, :, ::2]], [[0, 1]])
    copy_blocks([cache], [[0, 5]])
    np.testing.assert_array_equal(storage[5, :8], storage[0, :8])
    assert storage[5, 8] == 58.0  # the padding is left alone


def test_errors_name_the_argument() -> None:
    caches = [np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float32)]
    with pytest.raises(ValueError, match=r"block_mapping\[1\] holds block 4, outside \[0, 4\)"):
        copy_blocks(caches, [[0, 1], [2, 4]])
    with pytest.raises(ValueError, match=r"caches\[1\] float16\[4, 8\] on cpu differs"):
        copy_blocks([caches[0], np.zeros((4, 8), np.float16)], [[0, 1]])
    with pytest.raises(TypeError, match=r"caches\[0\] must be a tensor that supports DLPack"):
        copy_blocks([[1, 2]], [[0, 1]])
    with pytest.raises(TypeError, match="block_mapping must hold integers"):
        copy_blocks(caches, [[0.5, 1.0]])
    with pytest.raises(ValueError, match="int64 \\[num_pairs, 2\\]"):
        copy_blocks(caches, [0, 1, 2])
    with pytest.raises(ValueError, match="caches is empty"):
        copy_blocks([], [[0, 1]])
    with pytest.raises(TypeError, match="unsupported dtype"):
        copy_blocks([np.zeros((4, 2), np.complex64)], [[0, 1]])
    assert not caches[0].any()
    copy_blocks(caches, np.zeros((0, 2), np.int64))  # no pairs: nothing to do


def test_torch_tensors_when_available() -> None:
    torch = pytest.importorskip("torch")
    caches = [torch.randn(8, 16, 4, dtype=torch.bfloat16) for _ in range(2)]
    mapping = torch.tensor([[1, 6], [3, 0]])
    expected = [c.clone() for c in caches]
    for c in expected:
        c[6], c[0] = c[1].clone(), c[3].clone()
    copy_blocks(caches, mapping)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)
    if torch.cuda.is_available() and built_with_cuda():
        gpu = [c.cuda() for c in caches]
        copy_blocks(gpu, torch.tensor([[6, 2]]))
        for c in gpu:
            assert torch.equal(c[2], c[6])


def test_keys_and_values_in_their_own_layouts() -> None:
    rng = np.random.default_rng()
    keys = rng.standard_normal((6, 2, 32, 4)).astype(np.float32)  # [blocks, heads, head, block]
    values = rng.standard_normal((6, 2, 4, 32)).astype(np.float32)  # [blocks, heads, block, head]
    expected = reference([keys, values], np.array([[1, 4]]))
    copy_blocks([keys, values], [[1, 4]])
    np.testing.assert_array_equal(keys, expected[0])
    np.testing.assert_array_equal(values, expected[1])
    with pytest.raises(ValueError, match="num_blocks, block size"):
        copy_blocks([keys, np.zeros((6, 2, 2, 32), np.float32)], [[1, 4]])


def test_swap_blocks_between_two_caches() -> None:
    rng = np.random.default_rng()
    device_cache = rng.standard_normal((8, 2, 4, 16)).astype(np.float16)
    host_pool = np.zeros((3, 2, 4, 16), np.float16)
    swap_blocks(device_cache, host_pool, [[5, 0], [2, 2]])  # out to the pool
    np.testing.assert_array_equal(host_pool[0], device_cache[5])
    np.testing.assert_array_equal(host_pool[2], device_cache[2])
    assert not host_pool[1].any()
    swap_blocks(host_pool, device_cache, np.array([[0, 7]], np.int64))  # and back
    np.testing.assert_array_equal(device_cache[7], device_cache[5])
    with pytest.raises(ValueError, match=r"block_mapping\[0\] = \(3, 0\) is outside"):
        swap_blocks(host_pool, device_cache, np.array([[3, 0]], np.int64))
    with pytest.raises(ValueError, match="differ in dtype or block size"):
        swap_blocks(device_cache, host_pool.astype(np.float32), np.array([[0, 0]], np.int64))
