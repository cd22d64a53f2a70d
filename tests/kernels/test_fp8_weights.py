"""FP8 checkpoints' kernels: quantize_fp8_rows rounds activations as torch's float8_e4m3fn
cast does (per row or by a static scale), and dense / dense_silu_and_mul over panels of
fp8 codes are, in each build this CPU runs, the float32 products over the weights torch
dequantizes (e4m3 * scale), against float64 references too; bad operands are refused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers.dense_isa import ISAS, pinned_dense_isa

from pyengine import _C, ops
from pyengine.layers.quantization.fp8_w8a8 import FP8, pack_fp8, quantize_fp8


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    yield from pinned_dense_isa(request.param)


def torch_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference: torch's cast of x / scale (clamped to e4m3's range), times scale."""
    return (x / scale).clamp(-448, 448).to(FP8).float() * scale


def random_fp8(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weights over their whole range (subnormals too) and a scale per row."""
    w = torch.randn(rows, cols) * torch.logspace(-3, 2, cols)[torch.randperm(cols)]
    return w.clamp(-448, 448).to(FP8), torch.rand(rows) * 0.01 + 1e-4


def test_activations_round_as_torch_casts_them() -> None:
    x = torch.randn(9, 700) * torch.logspace(-8, 4, 700)
    x[4] = 0.0  # a zero row stays zeros
    x[5, :3] = torch.tensor([1e-30, -0.0, 3.3e-3])
    out = torch.empty_like(x)
    ops.quantize_fp8_rows(out, x, None)
    scale = x.abs().amax(dim=1, keepdim=True) / 448
    want = torch.where(scale == 0, 0.0, torch_e4m3(x, torch.where(scale == 0, 1.0, scale)))
    assert torch.equal(out, want)
    assert torch.equal(quantize_fp8(x, None), want)  # the torch path, for other devices
    static = torch.tensor([0.002])
    ops.quantize_fp8_rows(out, x, static)
    assert torch.equal(out, torch_e4m3(x, static))  # clamped at 448 * scale
    assert torch.equal(quantize_fp8(x, static), out)
    # Every e4m3 value and every midpoint between neighbours (ties to even), both signs.
    values = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()
    midpoints = (values[1:] + values[:-1]) / 2
    grid = torch.cat([values, midpoints, -values, -midpoints])[None]
    ops.quantize_fp8_rows(out[:1, : grid.shape[1]], grid, torch.tensor([1.0]))
    assert torch.equal(out[0, : grid.shape[1]], grid[0].to(FP8).float())
    ops.quantize_fp8_rows(x, x, None)  # in place
    assert torch.equal(x, want)


def test_activation_quantization_errors() -> None:
    x, out = torch.randn(2, 8), torch.empty(2, 8)
    for scale, message in (
        (torch.tensor([0.0]), "scale must be finite and positive"),
        (torch.tensor([float("inf")]), "scale must be finite and positive"),
        (torch.tensor([1.0, 2.0]), r"scale must be dense float32 \[1\]"),
    ):
        with pytest.raises(ValueError, match=message):
            ops.quantize_fp8_rows(out, x, scale)
    with pytest.raises(ValueError, match=r"out must be \[2, 8\]"):
        ops.quantize_fp8_rows(torch.empty(2, 7), x, None)


@pytest.mark.parametrize(
    ("m", "k", "n"), [(1, 32, 50), (1, 1536, 60), (3, 96, 100), (4, 576, 97), (21, 160, 49),
                      (300, 64, 60)]
)  # fmt: skip
def test_dense_of_fp8_panels_is_the_float32_dense_of_the_dequantized_weight(
    m: int, k: int, n: int, isa: str
) -> None:
    q, scale = random_fp8(n, k)
    w = q.float() * scale[:, None]  # as torch (and compressed-tensors) dequantize
    x, bias = torch.randn(m, k), torch.randn(n)
    packed = pack_fp8(q, scale, gate_up=False)
    # (no offsets: float32 scales alone, 1.125 bytes a weight)
    size = _C.packed_quantized_weight_size(k, n, 8, 32, "scale_float32")
    assert packed.dtype == FP8 and packed.numel() == size == -(-n // 48) * 48 * k * 1.125
    got, want = torch.empty(m, n), torch.empty(m, n)
    ops.dense(got, x, packed, bias, n)
    panels = torch.empty(_C.packed_weight_size(k, n))
    _C.pack_weight(panels, w.t().contiguous())
    ops.dense(want, x, panels, bias, n)
    # (The portable build's one row sums chunks of 64 k in two chains each: another order.)
    if m > 1 or isa == "avx512" or k <= 64:
        assert torch.equal(got, want)
    reference = x.double() @ w.double().t() + bias.double()
    assert (got - reference).abs().max() < 1e-4 * max(1.0, reference.abs().max().item())
    columns = torch.empty(3, k)
    ops.packed_columns(columns, packed, torch.tensor([0, n - 1, n // 2]), n)
    assert torch.equal(columns, w[[0, n - 1, n // 2]])


@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 40), (4, 96, 49), (16, 576, 70)])
def test_gated_dense_of_fp8_panels(m: int, k: int, n: int, isa: str) -> None:
    q, scale = random_fp8(2 * n, k)
    w = q.float() * scale[:, None]
    x = torch.randn(m, k)
    got, want = torch.empty(m, n), torch.empty(m, n)
    ops.dense_silu_and_mul(got, x, pack_fp8(q, scale, gate_up=True), n)
    panels = torch.empty(2 * _C.packed_weight_size(k, n))
    _C.pack_gate_up_weight(panels, w.t().contiguous())
    ops.dense_silu_and_mul(want, x, panels, n)
    assert torch.equal(got, want)


def test_fp8_packing_errors() -> None:
    k, n = 64, 50
    q = torch.randn(k, n).to(FP8)
    scale, offset = torch.rand(2, n), torch.zeros(2, n)
    packed = torch.empty(_C.packed_quantized_weight_size(k, n, 8), dtype=FP8)
    _C.pack_quantized_weight(packed, q, scale, offset)  # (with its zero offsets stored too)
    x, got, want = torch.randn(2, k), torch.empty(2, n), torch.empty(2, n)
    ops.dense(got, x, packed, None, n)
    each_weight = scale.repeat_interleave(32, dim=0).t()  # [n, k]: its group's scale
    scale_only = pack_fp8(q.t().contiguous(), each_weight, gate_up=False)
    assert scale_only.numel() < packed.numel()
    ops.dense(want, x, scale_only, None, n)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="fp8 weights take no offset"):
        _C.pack_quantized_weight(packed, q, scale, torch.full((2, n), 0.5))
    with_nan = q.clone()
    with_nan.view(torch.uint8)[3, 7] = 0x7F
    with pytest.raises(ValueError, match="fp8 q_t row 3 holds a NaN"):
        _C.pack_quantized_weight(packed, with_nan, scale, offset)
    with pytest.raises(ValueError, match="q_t must be"):
        _C.pack_quantized_weight(packed, q.view(torch.int8), scale, offset)
