"""fp8 and int8 KV caches on a CUDA GPU: reshape_and_cache from float16/bfloat16 K/V writes
exactly the bytes the CPU writes from the same values (float32 there), with and without a
checkpoint's static scales, and paged_attention over them agrees with attention over the
dequantized values in float64. (cpp/tests/test_cuda_cache_8bit.cpp runs the same kernels
on the host.) Skipped, with the reason shown, where there is no GPU or pyengine was built
without CUDA."""

from __future__ import annotations

import pytest
import torch
from helpers.attention import causal_attention

from pyengine import built_with_cuda, ops
from pyengine.config import INT8_SCALE_BYTES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and built_with_cuda()),
        reason="needs a CUDA GPU and pyengine built with CUDA",
    ),
]

KV_HEADS, HEADS, BLOCKS = 2, 8, 64
CACHES = {"int8": torch.int8, "fp8": torch.uint8}
DTYPES = [torch.float16, torch.bfloat16]


def empty_caches(
    kind: str, head_size: int, block: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    pad = INT8_SCALE_BYTES if kind == "int8" else 0
    dtype = CACHES[kind]
    key = torch.full((BLOCKS, KV_HEADS, head_size + pad, block), 0x5A, dtype=dtype, device=device)
    value = torch.full((BLOCKS, KV_HEADS, block, head_size + pad), 0x5A, dtype=dtype, device=device)
    return key, value


@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_size", "block"), [(64, 16), (80, 8), (128, 32)])
@pytest.mark.parametrize("scales", [(0.0, 0.0), (0.02, 0.01)], ids=["dynamic", "static"])
def test_the_gpu_writes_the_cpus_bytes(
    kind: str, dtype: torch.dtype, head_size: int, block: int, scales: tuple[float, float]
) -> None:
    tokens = 300
    key = (torch.randn(tokens, KV_HEADS, head_size) * 3).to(dtype)
    value = torch.randn(tokens, KV_HEADS, head_size).to(dtype)
    key[7, 1] = 0.0  # a row of zeros: int8's scale 0
    slots = torch.randperm(BLOCKS * block)[:tokens]
    slots[11] = -1  # padding
    gpu = empty_caches(kind, head_size, block, "cuda")
    cpu = empty_caches(kind, head_size, block, "cpu")
    ops.reshape_and_cache(key.cuda(), value.cuda(), *gpu, slots.cuda(), *scales)
    ops.reshape_and_cache(key.float(), value.float(), *cpu, slots, *scales)
    assert torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[1].cpu(), cpu[1])


def dequantized(cache: torch.Tensor, kind: str, head_size: int, is_key: bool) -> torch.Tensor:
    """A cache as float64 [blocks, heads, block, d]: int8 times each token's scale, fp8's
    e4m3 values."""
    if kind == "fp8":
        values = cache.view(torch.float8_e4m3fn).double()
        return values.transpose(2, 3) if is_key else values
    if is_key:
        q = cache[:, :, :head_size, :].transpose(2, 3).double()
        # a key tile's last 4 rows: its tokens' float32 scales, in order
        scale = cache[:, :, head_size:, :].reshape(BLOCKS, KV_HEADS, -1).view(torch.float32)
        scale = scale[..., None]
    else:
        q = cache[..., :head_size].double()
        scale = cache[..., head_size:].contiguous().view(torch.float32)
    return q * scale.double()


@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("context", "queries", "head_size", "block"),
    [(1, 1, 64, 16), (333, 1, 128, 16), (2000, 1, 64, 32), (150, 40, 80, 8), (700, 20, 128, 16)],
)
def test_attention_over_8bit_caches_on_the_gpu(
    kind: str, dtype: torch.dtype, context: int, queries: int, head_size: int, block: int
) -> None:
    key = torch.randn(context, KV_HEADS, head_size) * torch.rand(context, KV_HEADS, 1) * 3
    value = torch.randn(context, KV_HEADS, head_size)
    table = torch.randperm(BLOCKS)[: -(-context // block)].to(torch.int32)
    slots = table.long()[torch.arange(context) // block] * block + torch.arange(context) % block
    k8, v8 = empty_caches(kind, head_size, block, "cuda")
    ops.reshape_and_cache(key.to(dtype).cuda(), value.to(dtype).cuda(), k8, v8, slots.cuda())
    query = torch.randn(queries, HEADS, head_size).to(dtype)
    out = torch.full_like(query, float("nan")).cuda()
    ops.paged_attention(
        out,
        query.cuda(),
        k8,
        v8,
        table[None].cuda(),
        torch.tensor([context], dtype=torch.int32, device="cuda"),
        torch.tensor([0, queries], dtype=torch.int32, device="cuda"),
        head_size**-0.5,
    )
    keys = dequantized(k8.cpu(), kind, head_size, True)
    values = dequantized(v8.cpu(), kind, head_size, False)
    blocks, offsets = slots // block, slots % block
    want = causal_attention(query.double(), keys[blocks, :, offsets], values[blocks, :, offsets])
    tolerance = 5e-3 if dtype == torch.float16 else 2e-2  # the output's rounding
    error = (out.cpu().double() - want).abs().max() / want.abs().max()
    assert error < tolerance


def test_8bit_caches_on_cuda_take_16bit_activations_only() -> None:
    k8, v8 = empty_caches("int8", 64, 16, "cuda")
    key = torch.zeros(1, KV_HEADS, 64, device="cuda")
    slots = torch.zeros(1, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="key: over an fp8 or int8 cache on CUDA it must be"):
        ops.reshape_and_cache(key, key, k8, v8, slots)
