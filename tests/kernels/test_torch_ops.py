"""The kernels as torch.library custom ops: same results as the direct calls, and the
registrations pass torch's own op checks (schema, fake kernels, aliasing)."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pyengine import _C, ops  # noqa: E402


def test_ops_are_registered() -> None:
    for name in (
        "reshape_and_cache", "paged_attention", "copy_blocks", "swap_blocks", "rms_norm",
        "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "dense",
        "dense_silu_and_mul",
    ):  # fmt: skip
        assert hasattr(torch.ops.pyengine, name)


def make_inputs(dtype: torch.dtype) -> dict[str, object]:
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 31)))
    num_blocks, heads, q_heads, block, head = 8, 2, 4, 16, 64
    seq_lens = torch.tensor([20, 33], dtype=torch.int32)
    tables = torch.tensor([[5, 2, 0], [7, 1, 3]], dtype=torch.int32)
    qsl = torch.tensor([0, 4, 5], dtype=torch.int32)
    return {
        "key": torch.randn(53, heads, head, generator=gen).to(dtype),
        "value": torch.randn(53, heads, head, generator=gen).to(dtype),
        "key_cache": torch.zeros(num_blocks, heads, head, block, dtype=dtype),
        "value_cache": torch.zeros(num_blocks, heads, block, head, dtype=dtype),
        # Request 0's 20 tokens, then request 1's 33, each into its own blocks.
        "slot_mapping": torch.tensor(
            [
                int(tables[i, p // block]) * block + p % block
                for i, length in enumerate(seq_lens.tolist())
                for p in range(length)
            ]
        ),
        "query": torch.randn(5, q_heads, head, generator=gen).to(dtype),
        "block_tables": tables,
        "seq_lens": seq_lens,
        "query_start_loc": qsl,
        "scale": 1 / math.sqrt(head),
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_through_the_ops_matches_sdpa(dtype: str) -> None:
    x = make_inputs(getattr(torch, dtype))
    ops.reshape_and_cache(x["key"], x["value"], x["key_cache"], x["value_cache"], x["slot_mapping"])
    out = torch.full_like(x["query"], float("nan"))
    ops.paged_attention(
        out,
        x["query"],
        x["key_cache"],
        x["value_cache"],
        x["block_tables"],
        x["seq_lens"],
        x["query_start_loc"],
        x["scale"],
    )
    # Reference: SDPA over each request's dense K/V, in float64.
    starts = [0, 20]
    for i, (first, last) in enumerate([(0, 4), (4, 5)]):
        seq_len = int(x["seq_lens"][i])
        k = x["key"][starts[i] : starts[i] + seq_len].double().transpose(0, 1)
        v = x["value"][starts[i] : starts[i] + seq_len].double().transpose(0, 1)
        q = x["query"][first:last].double().transpose(0, 1)
        mask = torch.ones(last - first, seq_len, dtype=torch.bool).tril(seq_len - (last - first))
        ref = torch.nn.functional.scaled_dot_product_attention(
            q,
            k.repeat_interleave(2, 0),
            v.repeat_interleave(2, 0),
            attn_mask=mask,
            scale=x["scale"],
        )
        error = (out[first:last].double() - ref.transpose(0, 1)).abs().max() / ref.abs().max()
        assert error < (1e-5 if dtype == "float32" else 1e-2)


def test_opcheck() -> None:
    x = make_inputs(torch.float32)
    torch.library.opcheck(
        torch.ops.pyengine.reshape_and_cache.default,
        (x["key"], x["value"], x["key_cache"], x["value_cache"], x["slot_mapping"]),
    )
    out = torch.zeros_like(x["query"])
    torch.library.opcheck(
        torch.ops.pyengine.paged_attention.default,
        (
            out,
            x["query"],
            x["key_cache"],
            x["value_cache"],
            x["block_tables"],
            x["seq_lens"],
            x["query_start_loc"],
            x["scale"],
        ),
    )
    mapping = torch.tensor([[1, 4]], dtype=torch.int64)
    torch.library.opcheck(
        torch.ops.pyengine.copy_blocks.default, ([x["key_cache"]], [x["value_cache"]], mapping)
    )
    pool = torch.zeros(3, 2, 16, 64)
    torch.library.opcheck(
        torch.ops.pyengine.swap_blocks.default,
        (x["value_cache"], pool, torch.tensor([[1, 2]], dtype=torch.int64)),
    )


def test_opcheck_layer_ops() -> None:
    h, w = torch.randn(5, 64), torch.rand(64) + 0.5
    torch.library.opcheck(torch.ops.pyengine.rms_norm.default, (torch.empty_like(h), h, w, 1e-6))
    torch.library.opcheck(
        torch.ops.pyengine.fused_add_rms_norm.default, (h.clone(), torch.randn(5, 64), w, 1e-6)
    )
    q, k, cache = torch.randn(5, 4, 32), torch.randn(5, 2, 32), torch.randn(16, 32)
    positions = torch.tensor([0, 3, 15, 2, 1])
    torch.library.opcheck(torch.ops.pyengine.rotary_embedding.default, (positions, q, k, cache))
    torch.library.opcheck(
        torch.ops.pyengine.silu_and_mul.default, (torch.empty(5, 32), torch.randn(5, 64))
    )
    packed = torch.empty(_C.packed_weight_size(64, 50))
    _C.pack_weight(packed, torch.randn(64, 50))
    torch.library.opcheck(
        torch.ops.pyengine.dense.default, (torch.empty(5, 50), h, packed, torch.randn(50), 50)
    )
    gate_up = torch.empty(2 * _C.packed_weight_size(64, 50))
    _C.pack_gate_up_weight(gate_up, torch.randn(64, 100))
    torch.library.opcheck(
        torch.ops.pyengine.dense_silu_and_mul.default, (torch.empty(5, 50), h, gate_up, 50)
    )


def test_copy_and_swap_blocks() -> None:
    x = make_inputs(torch.float32)
    ops.reshape_and_cache(x["key"], x["value"], x["key_cache"], x["value_cache"], x["slot_mapping"])
    key_cache, value_cache = x["key_cache"], x["value_cache"]
    ops.copy_blocks([key_cache], [value_cache], torch.tensor([[5, 4]], dtype=torch.int64))
    assert torch.equal(key_cache[4], key_cache[5]) and torch.equal(value_cache[4], value_cache[5])
    pool = torch.zeros(3, *value_cache.shape[1:])
    ops.swap_blocks(value_cache, pool, torch.tensor([[7, 0]], dtype=torch.int64))
    assert torch.equal(pool[0], value_cache[7])


def test_ops_names_take_the_kernel_on_cpu_and_the_op_elsewhere() -> None:
    """ops.<name> calls CPU kernels directly in eager mode (the same result as the
    torch op); tensors on other devices keep the op, e.g. meta tensors its fake kernel."""
    h, residual, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    by_op = (h.clone(), residual.clone())
    torch.ops.pyengine.fused_add_rms_norm(*by_op, w, 1e-6)
    direct = (h.clone(), residual.clone())
    ops.fused_add_rms_norm(*direct, w, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(direct, by_op, strict=True))
    meta = [torch.empty(5, 64, device="meta") for _ in range(2)]
    ops.fused_add_rms_norm(*meta, torch.empty(64, device="meta"), 1e-6)  # the fake kernel
    with pytest.raises(ValueError, match="fused_add_rms_norm"):
        ops.fused_add_rms_norm(torch.randn(5, 64), torch.randn(5, 32), w, 1e-6)
