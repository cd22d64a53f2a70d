"""int8_dense (W8A8) in each build this CPU runs (AMX, AVX-512 VNNI, AVX2, portable): x
quantized per row as numpy rounds (ties to even), the int8 products summed exactly, both
scales applied: against a float64 reference of the same quantization, and bit for bit the
same in every build (a weight with a -128, which AVX2's sign trick cannot take, runs the
portable loops there); clear errors for what it cannot take."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.dense_isa import TILE_ISAS, pin_dense_isa, unpin_dense_isa

from pyengine import _C, ops


def packed(q: torch.Tensor) -> torch.Tensor:
    out = torch.empty(_C.packed_int8_weight_size(q.shape[1], q.shape[0]), dtype=torch.int8)
    _C.pack_int8_weight(out, q)
    return out


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):  # type: ignore[no-untyped-def]
    xs = x.numpy()
    sx = np.abs(xs).max(axis=1, keepdims=True) / np.float32(127)
    xq = np.clip(np.rint(xs / np.where(sx == 0, 1, sx)), -127, 127)
    out = (xq.astype(np.float64) @ q.numpy().astype(np.float64).T) * sx * scale.numpy()
    return out + (0 if bias is None else bias.numpy())


def run(isa: str, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):  # type: ignore[no-untyped-def]
    pin_dense_isa(isa)
    try:
        out = torch.empty(x.shape[0], scale.shape[0])
        ops.int8_dense(out, x, w, scale, bias, scale.shape[0])
        return out
    finally:
        unpin_dense_isa()


# (AMX: k a multiple of 64, from 8 rows; one and two row tiles, an odd panel count)
SIZES = [(1, 64, 16), (1, 576, 100), (3, 5, 17), (8, 1536, 48), (9, 577, 33), (130, 96, 1000),
         (17, 64, 16), (40, 128, 50), (100, 576, 100)]  # fmt: skip


@pytest.mark.parametrize(("m", "k", "n"), SIZES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("lowest", [-127, -128])
def test_int8_dense_is_the_w8a8_product(
    m: int, k: int, n: int, with_bias: bool, lowest: int
) -> None:
    q = torch.randint(lowest, 128, (n, k), dtype=torch.int8)
    q[0, 0] = lowest
    scale = torch.rand(n) * 0.02
    bias = torch.randn(n) if with_bias else None
    x = torch.randn(m, k) * torch.rand(m, 1) * 4
    x[0, : k // 2] = 0  # a half-zero row
    want = reference(x, q, scale, bias)
    results = [run(isa, x, packed(q), scale, bias) for isa in TILE_ISAS]
    for got in results:
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got, results[0])


def test_a_zero_row_and_no_rows() -> None:
    q = torch.randint(-127, 128, (20, 64), dtype=torch.int8)
    for isa in TILE_ISAS:
        out = run(isa, torch.zeros(2, 64), packed(q), torch.ones(20), None)
        assert torch.equal(out, torch.zeros(2, 20))
        assert run(isa, torch.zeros(0, 64), packed(q), torch.ones(20), None).shape == (0, 20)
        # A NaN (a broken model's) makes its row's outputs NaN, the other rows as they are.
        x = torch.randn(2, 64)
        x[1, 5] = float("nan")
        out = run(isa, x, packed(q), torch.ones(20), None)
        assert bool(out[1].isnan().all()) and torch.equal(
            out[0], run(isa, x[:1], packed(q), torch.ones(20), None)[0]
        )


def test_int8_dense_errors() -> None:
    q = torch.randint(-127, 128, (20, 64), dtype=torch.int8)
    w, x, out = packed(q), torch.randn(2, 64), torch.empty(2, 20)
    with pytest.raises(ValueError, match="q must be int8"):
        _C.pack_int8_weight(w, q.float())
    with pytest.raises(ValueError, match=r"packed must be dense int8 \["):
        _C.pack_int8_weight(w[:-1], q)
    with pytest.raises(ValueError, match=r"packed must be a packed int8 \[20, 32\] weight"):
        ops.int8_dense(out, x[:, :32], w, torch.ones(20), None, 20)
    with pytest.raises(ValueError, match=r"scale must be dense float32 \[20\]"):
        ops.int8_dense(out, x, w, torch.ones(19), None, 20)
    with pytest.raises(ValueError, match=r"out must be \[2, 20\]"):
        ops.int8_dense(torch.empty(3, 20), x, w, torch.ones(20), None, 20)
    with pytest.raises(ValueError, match=r"bias must be dense float32 \[20\]"):
        ops.int8_dense(out, x, w, torch.ones(20), torch.ones(20, dtype=torch.int32), 20)
