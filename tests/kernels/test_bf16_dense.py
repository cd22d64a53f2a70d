"""dense, dense_silu_and_mul and packed_columns over bfloat16 panels (a bfloat16 model's
weights on the CPU), in each build this CPU runs (AVX512-BF16's dot products where it
has them, the bfloat16s widened in registers otherwise, AMX's tile products for blocks
of rows where it has them): against a float64 reference of the exact products of the
bfloat16 operands, the float32 sum and one rounding to bfloat16; the vector builds' sums
the same bits; the fused activation rounding as the unfused
product and silu_and_mul do; clear errors for what does not fit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.dense_isa import ISAS, TILE_ISAS, pin_dense_isa, pinned_dense_isa

from pyengine import _C, ops

# m, k, n: a decode step's rows, a tile's, odd k and n, many rows over several blocks;
# the tile unit's (k a multiple of 32, from 8 rows) whole and partial row tiles, over
# several chunks of k (256 a chunk: 576 and 1056, the last chunk partial) and several
# blocks of rows (256 rows a block at k 2048, the last partial); a gate/up pair of k 32,
# n 16: the size of a split weight (told apart by x's dtype)
SIZES = [(1, 64, 48), (2, 33, 50), (5, 96, 97), (8, 576, 144), (13, 577, 60), (300, 130, 49),
         (40, 64, 100), (17, 96, 48), (200, 160, 150), (3, 32, 16), (40, 1056, 60),
         (300, 2048, 100)]  # fmt: skip


@pytest.fixture(params=TILE_ISAS, autouse=True)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    yield from pinned_dense_isa(request.param)


def bf16_packed(w_t: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    k, columns = w_t.shape
    n = columns // 2 if gate_up else columns
    packed = torch.empty((2 if gate_up else 1) * _C.packed_bf16_weight_size(k, n),
                         dtype=torch.bfloat16)  # fmt: skip
    _C.pack_bf16_weight(packed, w_t, gate_up)
    return packed


def assert_rounds_the_exact_product(
    out: torch.Tensor, x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """out within one rounding to bfloat16 (half its ulp: 2^-8 relative) of the exact
    product of x and w_t's bfloat16s, plus float32's summation error."""
    x64, w64 = x.double(), w_t.bfloat16().double()
    exact = x64 @ w64 + (0 if bias is None else bias.double())
    magnitude = x64.abs() @ w64.abs() + (0 if bias is None else bias.double().abs())
    summation = x.shape[1] * 2.0**-24 * magnitude
    error = (out.double() - exact).abs()
    assert bool((error <= 2.0**-8 * exact.abs() + 2 * summation + 1e-30).all()), (
        f"worst excess {(error - 2.0**-8 * exact.abs() - 2 * summation).max().item()}"
    )


@pytest.mark.parametrize(("m", "k", "n"), SIZES)
def test_dense_rounds_the_exact_product_once(m: int, k: int, n: int) -> None:
    x = torch.randn(m, k).bfloat16()
    w_t = torch.randn(k, n)
    bias = torch.randn(n).bfloat16()
    packed = bf16_packed(w_t)
    for b in (None, bias):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        ops.dense(out, x, packed, b, n)
        assert_rounds_the_exact_product(out, x, w_t, b)


@pytest.mark.parametrize(("m", "k", "n"), SIZES)
def test_every_build_gives_the_same_bits(isa: str, m: int, k: int, n: int) -> None:
    """vdpbf16ps adds a lane's odd product, then its even one, each rounded to float32
    (Intel's definition); the widened build adds them so, and products of bfloat16s are
    exact: the sums agree bit for bit."""
    x = torch.randn(m, k).bfloat16()
    packed = bf16_packed(torch.randn(k, n))
    outs = []
    for build in ISAS:  # (AMX's tile products sum in an order of their own)
        pin_dense_isa(build)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        ops.dense(out, x, packed, None, n)
        outs.append(out)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_a_strided_x_and_out() -> None:
    """Rows of a wider buffer: x's and out's rows their stride apart."""
    x_wide = torch.randn(7, 90).bfloat16()
    out_wide = torch.zeros(7, 80, dtype=torch.bfloat16)
    w_t = torch.randn(64, 50)
    ops.dense(out_wide[:, :50], x_wide[:, :64], bf16_packed(w_t), None, 50)
    assert_rounds_the_exact_product(out_wide[:, :50], x_wide[:, :64], w_t, None)
    assert bool((out_wide[:, 50:] == 0).all())


@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 48), (6, 33, 50), (40, 96, 100),
                                           (270, 2048, 50)])  # fmt: skip
def test_silu_and_mul_rounds_as_the_unfused_ops(m: int, k: int, n: int) -> None:
    x = torch.randn(m, k).bfloat16()
    w_t = torch.randn(k, 2 * n)  # gate columns, then up
    fused = torch.empty(m, n, dtype=torch.bfloat16)
    ops.dense_silu_and_mul(fused, x, bf16_packed(w_t, gate_up=True), n)
    product = torch.empty(m, 2 * n, dtype=torch.bfloat16)
    ops.dense(product, x, bf16_packed(w_t), None, 2 * n)
    unfused = torch.empty(m, n, dtype=torch.bfloat16)
    ops.silu_and_mul(unfused, product)
    assert torch.equal(fused, unfused)


def test_packed_columns_are_the_bfloat16_weights() -> None:
    w_t = torch.randn(33, 100)
    ids = torch.tensor([0, 99, 47, 48, 3, 3])
    out = torch.empty(len(ids), 33, dtype=torch.bfloat16)
    ops.packed_columns(out, bf16_packed(w_t), ids, 100)
    assert torch.equal(out, w_t.bfloat16().t()[ids])
    with pytest.raises(ValueError, match=r"ids\[0\] is 100"):
        ops.packed_columns(out[:1], bf16_packed(w_t), torch.tensor([100]), 100)
    with pytest.raises(ValueError, match="bfloat16"):
        ops.packed_columns(torch.empty(1, 33), bf16_packed(w_t), torch.tensor([1]), 100)


def test_bad_arguments_are_clear_errors() -> None:
    w_t = torch.randn(64, 48)
    packed = bf16_packed(w_t)
    x = torch.randn(3, 64)
    # float32 x takes a bfloat16 buffer as a split weight, and says what panels take.
    with pytest.raises(ValueError, match="float32 x.*pack_bf16_weight, take bfloat16 x"):
        ops.dense(torch.empty(3, 48), x, packed, None, 48)
    with pytest.raises(ValueError, match="out must be .*bfloat16"):
        ops.dense(torch.empty(3, 48), x.bfloat16(), packed, None, 48)
    with pytest.raises(ValueError, match=r"bias must be bfloat16 \[48\]"):
        ops.dense(torch.empty(3, 48, dtype=torch.bfloat16), x.bfloat16(), packed,
                  torch.zeros(47, dtype=torch.bfloat16), 48)  # fmt: skip
    with pytest.raises(ValueError, match="bias"):
        ops.dense(torch.empty(3, 48, dtype=torch.bfloat16), x.bfloat16(), packed,
                  torch.zeros(48), 48)  # fmt: skip
    # A bfloat16 buffer not the panels' size names both forms.
    with pytest.raises(ValueError, match="pack_bf16_weight.*pack_split_weight"):
        ops.dense(torch.empty(3, 48, dtype=torch.bfloat16), x.bfloat16(), packed[:-2], None, 48)
    with pytest.raises(ValueError, match="dense bfloat16"):
        _C.pack_bf16_weight(packed[:-1], w_t)
    with pytest.raises(ValueError, match="gate columns, then up"):
        _C.pack_bf16_weight(packed, torch.randn(64, 47), True)
    with pytest.raises(ValueError, match="must be >= 0"):
        _C.packed_bf16_weight_size(-1, 4)


def test_the_dot_product_build_is_used_where_the_cpu_has_it(isa: str) -> None:
    has_bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text().split()
    assert _C.bf16_dot_product() == (isa in ("avx512", "amx") and has_bf16)
    assert _C.amx_tiles() == (isa == "amx")
