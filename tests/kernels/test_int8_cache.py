"""int8 KV caches with a scale per token and kv head, on the CPU: reshape_and_cache
writes q = round(x / s), s = max|x| / 127, and s beside each token's values (the head
dims 4 bytes longer); paged_attention over them matches attention over the dequantized
values q * s in float64, in every build of the kernel and for a decode's few rows as for
a prefill's many; static per-tensor scales (a checkpoint's) replace the rows' own. (The
engine's run with kv_cache_dtype="int8": test_fp8_cache.py.)"""

from __future__ import annotations

import pytest
import torch
from helpers.attention import causal_attention, check_float32_inputs_only

from pyengine import _C, ops
from pyengine.config import INT8_SCALE_BYTES

ISAS = [isa for isa in ("generic", "avx2", "avx512") if _C.cpu_supports(isa)]
KV_HEADS, HEADS, HEAD_SIZE, BLOCK, BLOCKS = 2, 8, 64, 16, 48
PADDED = HEAD_SIZE + INT8_SCALE_BYTES


def int8_caches(block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    key = torch.zeros(BLOCKS, KV_HEADS, PADDED, block, dtype=torch.int8)
    value = torch.zeros(BLOCKS, KV_HEADS, block, PADDED, dtype=torch.int8)
    return key, value


def dequantized(x: torch.Tensor) -> torch.Tensor:
    """The reference: each [token, head] row as round(x / s) * s in float64."""
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(scale == 0, 0.0, torch.round(x / torch.where(scale == 0, 1.0, scale)))
    return q.clamp(-127, 127).double() * scale.double()


def test_reshape_and_cache_writes_each_rows_int8_and_scale() -> None:
    tokens = 37
    key = torch.randn(tokens, KV_HEADS, HEAD_SIZE) * torch.logspace(-4, 3, HEAD_SIZE)
    value = torch.randn(tokens, KV_HEADS, HEAD_SIZE) * 2
    value[3, 1] = 0.0  # a zero row: scale 0, values 0
    slots = torch.randperm(BLOCKS * BLOCK)[:tokens]
    k8, v8 = int8_caches()
    ops.reshape_and_cache(key, value, k8, v8, slots)
    blocks, offsets = slots // BLOCK, slots % BLOCK
    key_q = k8[blocks, :, :HEAD_SIZE, offsets].float()  # [tokens, heads, d]
    # a key tile's last 4 rows: its tokens' float32 scales, in order
    key_scale = k8[:, :, HEAD_SIZE:, :].reshape(BLOCKS, KV_HEADS, -1).view(torch.float32)
    value_q = v8[blocks, :, offsets, :HEAD_SIZE].float()
    value_scale = v8[:, :, :, HEAD_SIZE:].contiguous().view(torch.float32)
    for q, scales, x in (
        (key_q, key_scale[blocks, :, offsets], key),
        (value_q, value_scale[blocks, :, offsets, 0], value),
    ):
        want_scale = x.abs().amax(dim=-1) / 127
        assert torch.equal(scales, want_scale)
        safe = torch.where(want_scale == 0, 1.0, want_scale)[..., None]
        assert torch.equal(q, torch.round(x / safe).clamp(-127, 127))
    assert (value_q[3, 1] == 0).all()
    # A NaN (a broken model's) is stored as 0, its row's other values as they are.
    key[5, 0, 7] = float("nan")
    ops.reshape_and_cache(key, value, k8, v8, slots)
    row = k8[blocks[5], 0, :HEAD_SIZE, offsets[5]].float()
    assert row[7] == 0 and torch.equal(row[:7], key_q[5, 0, :7])


def test_static_scales_replace_each_rows_own() -> None:
    """A checkpoint's per-tensor k_scale/v_scale: q = round(x / s) clamped to [-128, 127], s
    beside every token."""
    tokens = 20
    key, value = torch.randn(tokens, KV_HEADS, HEAD_SIZE), torch.randn(tokens, KV_HEADS, HEAD_SIZE)
    slots = torch.randperm(BLOCKS * BLOCK)[:tokens]
    k8, v8 = int8_caches()
    ops.reshape_and_cache(key, value, k8, v8, slots, 0.01, 0.5)
    blocks, offsets = slots // BLOCK, slots % BLOCK
    key_scale = k8[:, :, HEAD_SIZE:, :].reshape(BLOCKS, KV_HEADS, -1).view(torch.float32)
    value_scale = v8[:, :, :, HEAD_SIZE:].contiguous().view(torch.float32)
    assert bool((key_scale[blocks, :, offsets] == 0.01).all())
    assert bool((value_scale[blocks, :, offsets, 0] == 0.5).all())
    key_q = k8[blocks, :, :HEAD_SIZE, offsets].float()
    # (a checkpoint's scale: compressed-tensors' int8 range, [-128, 127]; |k| > 1.27 clamps)
    assert torch.equal(key_q, torch.round(key / 0.01).clamp(-128, 127))
    value_q = v8[blocks, :, offsets, :HEAD_SIZE].float()
    assert torch.equal(value_q, torch.round(value / 0.5).clamp(-128, 127))
    with pytest.raises(ValueError, match="k_scale must be finite and >= 0"):
        ops.reshape_and_cache(key, value, k8, v8, slots, -1.0, 0.5)
    kf = torch.zeros(BLOCKS, KV_HEADS, HEAD_SIZE, BLOCK)
    vf = torch.zeros(BLOCKS, KV_HEADS, BLOCK, HEAD_SIZE)
    with pytest.raises(ValueError, match="static scales are for int8 and fp8 caches"):
        ops.reshape_and_cache(key, value, kf, vf, slots, 0.01, 0.5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("context", "queries", "block"), [(1, 1, 16), (100, 1, 16), (333, 1, 16), (77, 77, 16),
                                      (200, 30, 16), (90, 1, 8), (150, 40, 32)]
)  # fmt: skip
def test_attention_over_int8_is_attention_over_its_dequantized_values(
    isa: str, context: int, queries: int, block: int
) -> None:
    key = torch.randn(context, KV_HEADS, HEAD_SIZE) * torch.rand(context, KV_HEADS, 1) * 3
    value = torch.randn(context, KV_HEADS, HEAD_SIZE)
    table = torch.randperm(BLOCKS)[: -(-context // block)].to(torch.int32)
    slots = table.long()[torch.arange(context) // block] * block + torch.arange(context) % block
    k8, v8 = int8_caches(block)
    ops.reshape_and_cache(key, value, k8, v8, slots)
    query = torch.randn(queries, HEADS, HEAD_SIZE)
    args = (table[None], torch.tensor([context], dtype=torch.int32),
            torch.tensor([0, queries], dtype=torch.int32), HEAD_SIZE**-0.5)  # fmt: skip
    _C.set_attention_isa(isa)
    try:
        out = torch.empty_like(query)
        ops.paged_attention(out, query, k8, v8, *args)
    finally:
        _C.set_attention_isa("auto")
    want = causal_attention(query, dequantized(key), dequantized(value))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_int8_caches_are_checked() -> None:
    k8, v8 = int8_caches()
    check_float32_inputs_only(k8, v8, HEADS, HEAD_SIZE)
    query = torch.zeros(1, HEADS, HEAD_SIZE)  # (a shape error: its values do not matter)
    args = (torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), 0.125)  # fmt: skip
    unpadded = torch.zeros(BLOCKS, KV_HEADS, HEAD_SIZE, BLOCK, dtype=torch.int8)
    with pytest.raises(ValueError, match="key_cache .* must be value_cache"):
        ops.paged_attention(query, query, unpadded, v8, *args)
