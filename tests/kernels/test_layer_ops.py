"""The fused layer ops against float64 torch references, on fresh random inputs, and their
argument checks."""

from __future__ import annotations

import pytest
import torch
from helpers.layer_ops import DTYPES, TOLERANCE, rel_error, rms_norm_reference, rotary_reference

from pyengine import _C, ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    x = torch.randn(37, hidden).to(dtype)
    weight = torch.rand(hidden).to(dtype) + 0.5
    out = torch.full_like(x, float("nan"))
    ops.rms_norm(out, x, weight, 1e-6)
    assert rel_error(out, rms_norm_reference(x, weight, 1e-6)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype: torch.dtype) -> None:
    x, residual = torch.randn(2, 300, 256).to(dtype)
    weight = torch.rand(256).to(dtype) + 0.5
    stream = residual.double() + x.double()
    want = rms_norm_reference(stream, weight, 1e-5)
    ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert rel_error(residual, stream) < TOLERANCE[dtype]
    assert rel_error(x, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_each_head(dtype: torch.dtype) -> None:
    """[tokens, heads, head_size] rows with dense heads (q's heads in a fused qkv output,
    Qwen3's per-head norms): each head normed alone; other head layouts are refused."""
    qkv = torch.randn(7, (6 + 2 * 2) * 64).to(dtype)
    q = qkv[:, : 6 * 64].view(7, 6, 64)
    weight = torch.rand(64).to(dtype) + 0.5
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    ops.rms_norm(out, q, weight, 1e-6)
    assert rel_error(out, rms_norm_reference(q, weight, 1e-6)) < TOLERANCE[dtype]
    with pytest.raises(ValueError, match="must have dense heads"):
        ops.rms_norm(out, qkv.view(7, 10, 64)[:, ::2][:, :6], weight, 1e-6)
    with pytest.raises(ValueError, match="disagree in shape"):
        ops.rms_norm(out[:, :5], q, weight, 1e-6)


def test_rms_norm_rounds_like_torch_float32() -> None:
    # The model's greedy tokens equal transformers' only if the norm rounds as its ops do.
    x = torch.randn(64, 576)
    weight = torch.rand(576) + 0.5
    out = torch.empty_like(x)
    ops.rms_norm(out, x, weight, 1e-5)
    want = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert (out - want).abs().max().item() < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [32, 64, 128])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_rotary_embedding(dtype: torch.dtype, head_size: int, is_neox: bool) -> None:
    tokens, heads, kv_heads, max_positions = 23, 6, 2, 500
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_size, 2).double() / head_size))
    freqs = torch.arange(max_positions).double()[:, None] * inv_freq
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()
    positions = torch.randint(0, max_positions, (tokens,))
    # q and k as strided views of one fused qkv row, as the model passes them.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size).to(dtype)
    q = qkv[:, : heads * head_size].view(tokens, heads, head_size)
    k = qkv[:, heads * head_size : (heads + kv_heads) * head_size].view(tokens, kv_heads, head_size)
    q0, k0 = q.double().clone(), k.double().clone()
    ops.rotary_embedding(positions.to(torch.int32), q, k, cache, is_neox)
    assert rel_error(q, rotary_reference(q0, freqs, positions, is_neox)) < TOLERANCE[dtype]
    assert rel_error(k, rotary_reference(k0, freqs, positions, is_neox)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = (torch.randn(41, 2 * 384) * 4).to(dtype)
    out = torch.full((41, 384), float("nan"), dtype=dtype)
    ops.silu_and_mul(out, x)
    xd = x.double()
    want = torch.nn.functional.silu(xd[:, :384]) * xd[:, 384:]
    assert rel_error(out, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float16])
def test_gelu_tanh_and_mul_and_scale(dtype: torch.dtype) -> None:
    """Gemma's GeGLU (gelu's tanh approximation) and its embeddings' scale (the CPU's)."""
    x = (torch.randn(41, 2 * 384) * 4).to(dtype)
    out = torch.full((41, 384), float("nan"), dtype=dtype)
    ops.gelu_tanh_and_mul(out, x)
    xd = x.double()
    want = torch.nn.functional.gelu(xd[:, :384], approximate="tanh") * xd[:, 384:]
    assert rel_error(out, want) < TOLERANCE[dtype]
    scaled = torch.full_like(x, float("nan"))
    ops.scale(scaled, x, 8.0)
    assert torch.equal(scaled, x * 8.0)  # (exact: a power of two)
    with pytest.raises(ValueError, match="need x \\[tokens, 2n\\]"):
        ops.gelu_tanh_and_mul(out, x[:, :100])
    with pytest.raises(ValueError, match="out must be x's shape"):
        ops.scale(out, x, 2.0)


def test_bad_arguments_are_clear_errors() -> None:
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="disagree in shape"):
        ops.rms_norm(torch.empty(4, 64), x, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="eps must be > 0"):
        ops.rms_norm(torch.empty(4, 64), x, torch.ones(64), 0.0)
    with pytest.raises(ValueError, match="x must be float32, float16 or bfloat16"):
        ops.rms_norm(torch.empty(4, 64), x.to(torch.int32), torch.ones(64), 1e-6)
    with pytest.raises(TypeError, match="unsupported dtype"):
        ops.rms_norm(torch.empty(4, 64), x.to(torch.float64), torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="out must be float32"):
        ops.silu_and_mul(torch.empty(4, 32, dtype=torch.float16), x)
    with pytest.raises(ValueError, match=r"need x \[tokens, 2n\]"):
        ops.silu_and_mul(torch.empty(4, 31), x)
    q, k = torch.randn(3, 2, 64), torch.randn(3, 1, 64)
    cache = torch.randn(10, 64)
    with pytest.raises(ValueError, match=r"positions\[1\] = 10 is outside \[0, 10\)"):
        ops.rotary_embedding(torch.tensor([0, 10, 2]), q, k, cache)
    with pytest.raises(ValueError, match="positions must be int32 or int64"):
        ops.rotary_embedding(torch.tensor([0.0, 1.0, 2.0]), q, k, cache)
    with pytest.raises(ValueError, match="disagree"):
        ops.rotary_embedding(torch.tensor([0, 1]), q, k, cache)
    assert torch.isfinite(q).all()  # nothing written before an error


def test_written_tensors_must_not_share_memory() -> None:
    """An `expand`ed tensor has every row in one row's memory: an op that writes it would
    write them all as one (and read what it just wrote). Read-only ones are fine."""
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    row = torch.randn(1, 8).expand(3, 8)
    with pytest.raises(ValueError, match="out is written, but its elements share memory"):
        ops.rms_norm(torch.empty(1, 8).expand(3, 8), x, torch.ones(8), 1e-6)
    out = torch.empty(3, 8)
    ops.rms_norm(out, row, torch.ones(8), 1e-6)  # an expanded input: read only
    assert torch.allclose(out, out[:1].expand(3, 8))
    for args in ((row, residual), (x, row)):
        with pytest.raises(ValueError, match="(x|residual) is written, but its elements share"):
            ops.fused_add_rms_norm(*args, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="out is written"):
        ops.silu_and_mul(torch.empty(1, 4).expand(3, 4), x)
    q = torch.randn(1, 2, 64).expand(3, 2, 64)
    with pytest.raises(ValueError, match="query is written"):
        ops.rotary_embedding(torch.tensor([0, 1, 2]), q, torch.randn(3, 1, 64), torch.randn(10, 64))


def test_a_size_one_dim_may_have_any_stride() -> None:
    """torch calls a tensor whose last dim has size 1 contiguous whatever its stride (as
    `.t()` of a [1, k] tensor makes); so do the ops, which refused it as no dense last dim."""
    w_t = torch.randn(1, 64).t().contiguous()  # [64, 1], strides (1, 64)
    assert w_t.is_contiguous() and w_t.stride(1) == 64
    packed = torch.empty(_C.packed_weight_size(64, 1))
    _C.pack_weight(packed, w_t)
    x = torch.randn(3, 64)
    out = torch.randn(1, 3).t()  # [3, 1], strides (1, 3)
    ops.dense(out, x, packed, None, 1)
    assert torch.allclose(out, x @ w_t, atol=1e-4)


@pytest.mark.parametrize("m", [1, 3, 8, 32, 77])
@pytest.mark.parametrize(("k", "n"), [(64, 48), (576, 960), (100, 70), (33, 5)])
def test_dense_matches_float64(m: int, k: int, n: int) -> None:
    w_t = torch.randn(k, n)
    packed = torch.full((_C.packed_weight_size(k, n),), float("nan"))
    _C.pack_weight(packed, w_t)
    x = torch.randn(m, k)
    bias = torch.randn(n)
    for b in (None, bias):
        out = torch.full((m, n), float("nan"))
        ops.dense(out, x, packed, b, n)
        want = x.double() @ w_t.double() + (0 if b is None else b.double())
        assert rel_error(out, want) < 1e-5


@pytest.mark.parametrize("m", [1, 3, 8, 32, 77, 200])
@pytest.mark.parametrize(("k", "n"), [(64, 48), (576, 1536), (100, 70), (33, 5)])
def test_dense_silu_and_mul_matches_float64(m: int, k: int, n: int) -> None:
    w_t = torch.randn(k, 2 * n)
    packed = torch.full((2 * _C.packed_weight_size(k, n),), float("nan"))
    _C.pack_gate_up_weight(packed, w_t)
    x = torch.randn(m, k)
    out = torch.full((m, n), float("nan"))
    ops.dense_silu_and_mul(out, x, packed, n)
    gate_up = x.double() @ w_t.double()
    want = torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
    assert rel_error(out, want) < 1e-5
    # The activation rounds as the separate op's, over the same float32 product.
    separate = torch.empty(m, n)
    product = torch.empty(m, 2 * n)
    dense_packed = torch.empty(_C.packed_weight_size(k, 2 * n))
    _C.pack_weight(dense_packed, w_t)
    ops.dense(product, x, dense_packed, None, 2 * n)
    ops.silu_and_mul(separate, product)
    assert torch.equal(out, separate)


@pytest.mark.parametrize(("m", "k"), [(0, 64), (5, 0)])
def test_dense_of_empty_operands(m: int, k: int) -> None:
    """No rows, or no inner dimension (a product of zeros: the bias, or zero)."""
    n = 50
    packed = torch.empty(_C.packed_weight_size(k, n))
    _C.pack_weight(packed, torch.randn(k, n))
    bias = torch.randn(n)
    out = torch.full((m, n), float("nan"))
    ops.dense(out, torch.randn(m, k), packed, bias, n)
    assert torch.equal(out, bias.expand(m, n))
    gate_up = torch.empty(2 * _C.packed_weight_size(k, n))
    _C.pack_gate_up_weight(gate_up, torch.randn(k, 2 * n))
    out = torch.full((m, n), float("nan"))
    ops.dense_silu_and_mul(out, torch.randn(m, k), gate_up, n)
    assert torch.equal(out, torch.zeros(m, n))


def test_dense_bad_arguments() -> None:
    w_t = torch.randn(64, 50)
    packed = torch.empty(_C.packed_weight_size(64, 50))
    _C.pack_weight(packed, w_t)
    with pytest.raises(ValueError, match="packed must be a packed"):
        ops.dense(torch.empty(2, 50), torch.randn(2, 63), packed, None, 50)
    with pytest.raises(ValueError, match=r"out must be \[2, 50\]"):
        ops.dense(torch.empty(2, 49), torch.randn(2, 64), packed, None, 50)
    with pytest.raises(ValueError, match="bias must be dense float32"):
        ops.dense(torch.empty(2, 50), torch.randn(2, 64), packed, torch.randn(49), 50)
    with pytest.raises(ValueError, match="packed must be dense float32"):
        _C.pack_weight(torch.empty(10), w_t)
    gate_up = torch.empty(2 * _C.packed_weight_size(64, 25))
    with pytest.raises(ValueError, match=r"w_t must be \[k, 2n\]"):
        _C.pack_gate_up_weight(gate_up, torch.randn(64, 49))
    with pytest.raises(ValueError, match="packed must be dense float32"):
        _C.pack_gate_up_weight(torch.empty(10), w_t)
    _C.pack_gate_up_weight(gate_up, w_t)
    with pytest.raises(ValueError, match=r"packed must be a packed .*\(pack_gate_up_weight\)"):
        ops.dense_silu_and_mul(torch.empty(2, 25), torch.randn(2, 64), gate_up[:-1], 25)
    with pytest.raises(ValueError, match=r"out must be \[2, 25\]"):
        ops.dense_silu_and_mul(torch.empty(2, 50), torch.randn(2, 64), gate_up, 25)
