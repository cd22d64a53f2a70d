"""dense and dense_silu_and_mul over split-bfloat16 weights (AMX): as accurate as a float32
matmul, checked against float64 on fresh random inputs; the layers take the split form for
many rows only; clear errors for what cannot be packed or run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pyengine import _C, ops
from pyengine.layers.linear import LayerContext, linear_from_weight
from pyengine.layers.quantization import unquantized

needs_amx = pytest.mark.skipif(
    not _C.split_gemm_supported(), reason="no AMX with bfloat16 on this CPU (or not allowed)"
)


def split_packed(w: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """w [out, in] packed for the split path."""
    out_features, in_features = w.shape
    n = out_features // 2 if gate_up else out_features
    packed = torch.empty(_C.packed_split_weight_size(in_features, n, gate_up), dtype=torch.bfloat16)
    _C.pack_split_weight(packed, w.t().contiguous(), gate_up)
    return packed


def float32_error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Elementwise, what a float32 matmul may be off by: a few units of float32 rounding
    times the sum of |products| (the split's dropped partial products are below 2^-23 of
    each product; its float32 sums round like any float32 GEMM's)."""
    k = x.shape[1]
    return 4 * k**0.5 * 2.0**-24 * (x.double().abs() @ w.double().abs().t()) + 1e-30


# (m, k, n): odd tails of every blocking (rows past 32, k past 32, columns past 16/32),
# a block of rows past the kernel's row block, and SmolLM2's shapes.
SHAPES = [(1, 1, 1), (5, 40, 20), (33, 64, 48), (97, 100, 33), (300, 576, 960), (64, 1536, 576)]


@needs_amx
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_dense_matches_float64(m: int, k: int, n: int, with_bias: bool) -> None:
    x, w = torch.randn(m, k), torch.randn(n, k)
    bias = torch.randn(n) if with_bias else None
    out = torch.full((m, n), float("nan"))
    ops.dense(out, x, split_packed(w), bias, n)
    reference = x.double() @ w.double().t() + (bias.double() if bias is not None else 0)
    error = (out.double() - reference).abs()
    # (plus the rounding of the bias's addition)
    assert (error <= float32_error_bound(x, w) + 2.0**-23 * reference.abs()).all(), error.max()
    if k >= 64:  # where sums, not single products, set the error: about float32's own
        float32_error = (F.linear(x, w, bias).double() - reference).abs().max()
        assert error.max() <= 4 * float32_error


@needs_amx
@pytest.mark.parametrize("m,k,n", [(1, 32, 16), (45, 70, 17), (130, 576, 1536)])
def test_dense_silu_and_mul_matches_float64(m: int, k: int, n: int) -> None:
    x, w = torch.randn(m, k), torch.randn(2 * n, k) * 0.2
    out = torch.full((m, n), float("nan"))
    ops.dense_silu_and_mul(out, x, split_packed(w, gate_up=True), n)
    products = x.double() @ w.double().t()
    gate, up = products[:, :n], products[:, n:]
    reference = F.silu(gate) * up
    # the products' bounds carried through silu(g) * u (|silu'| < 1.1)
    bound = float32_error_bound(x, w)
    slack = (
        1.1 * bound[:, :n] * up.abs() + F.silu(gate).abs() * bound[:, n:] + 1e-6 * reference.abs()
    )
    error = (out.double() - reference).abs()
    assert (error <= slack + 1e-12).all(), error.max()


@needs_amx
@pytest.mark.parametrize("m,k,n", [(0, 32, 16), (3, 0, 5)])
def test_empty_sizes(m: int, k: int, n: int) -> None:
    out = torch.full((m, n), float("nan"))
    ops.dense(out, torch.randn(m, k), split_packed(torch.randn(n, k)), None, n)
    assert torch.equal(out, torch.zeros(m, n))


@needs_amx
def test_exact_where_the_inputs_are_bfloat16() -> None:
    """bfloat16 x and w are their own hi parts: every product is exact, and the sums of
    small integers too."""
    x = torch.randint(-8, 8, (40, 96)).float()
    w = torch.randint(-8, 8, (50, 96)).float()
    out = torch.empty(40, 50)
    ops.dense(out, x, split_packed(w), None, 50)
    assert torch.equal(out, x @ w.t())


@needs_amx
def test_layers_take_the_split_form_for_many_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYENGINE_SPLIT_GEMM", raising=False)
    weight, gate_up = torch.randn(96, 64), torch.randn(2 * 80, 64)
    dense = linear_from_weight(weight, LayerContext())
    gated = linear_from_weight(gate_up, LayerContext(), gate_up=True)
    assert dense.method_state.split is not None and gated.method_state.split is not None
    calls: list[torch.dtype] = []
    for name in ("dense", "dense_silu_and_mul"):
        real = getattr(ops, name)

        def record(
            out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, *rest: object, real=real
        ) -> None:  # noqa: ANN001
            calls.append(packed.dtype)
            real(out, x, packed, *rest)

        monkeypatch.setattr(unquantized.ops, name, record)
    for rows, dtype in ((unquantized.SPLIT_MIN_ROWS, torch.bfloat16), (4, torch.float32)):
        calls.clear()
        x = torch.randn(rows, 64)
        y, z = dense(x), gated.silu_and_mul(x)
        assert calls == [dtype, dtype]
        products = x.double() @ gate_up.double().t()
        torch.testing.assert_close(
            y.double(), x.double() @ weight.double().t(), rtol=1e-4, atol=1e-4
        )
        expected = F.silu(products[:, :80]) * products[:, 80:]
        torch.testing.assert_close(z.double(), expected, rtol=1e-4, atol=1e-4)


def test_split_form_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYENGINE_SPLIT_GEMM", "0")
    assert not unquantized.split_gemm_enabled()
    assert linear_from_weight(torch.randn(8, 32), LayerContext()).method_state.split is None


def test_head_keeps_no_split_form() -> None:
    head = linear_from_weight(torch.randn(8, 32), LayerContext(), many_rows=False)
    assert head.method_state.split is None


@needs_amx
def test_bad_packed_weights_are_clear_errors() -> None:
    w = torch.randn(16, 64)
    packed = split_packed(w)
    x, out = torch.randn(4, 64), torch.empty(4, 16)
    with pytest.raises(ValueError, match="split"):
        ops.dense(out, x, packed[:-1], None, 16)  # wrong size
    with pytest.raises(ValueError, match="split"):
        ops.dense(torch.empty(4, 40), x, packed, None, 40)  # packed for fewer columns
    with pytest.raises(ValueError, match="k, 2n"):
        _C.pack_split_weight(packed, torch.randn(64, 15), True)
    with pytest.raises(ValueError, match="bfloat16"):
        _C.pack_split_weight(torch.empty(packed.numel()), w.t().contiguous(), False)
    with pytest.raises(ValueError, match="dense bfloat16"):
        _C.pack_split_weight(packed[:-1], w.t().contiguous(), False)
    with pytest.raises(ValueError, match="must be >= 0"):
        _C.packed_split_weight_size(-1, 4, False)


@pytest.mark.skipif(_C.split_gemm_supported(), reason="this CPU runs the split form")
def test_split_weight_without_amx_is_a_clear_error() -> None:
    packed = torch.zeros(_C.packed_split_weight_size(32, 16, False), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="AMX"):
        ops.dense(torch.empty(2, 16), torch.randn(2, 32), packed, None, 16)
