"""dense and dense_silu_and_mul over block-quantized weights (GGUF's Q4_0/Q4_1/Q8_0/Q6_K
form), in each build of the widening this CPU runs (AVX-512, with its multiply of a
decode step's rows in registers, and the portable one): bit for bit the float32 matmul
over the widened weight, which is the weight the loader dequantizes; with
int8_activations, a decode step's rows quantized to int8 per block and multiplied in
integers (VNNI, AVX2's vpmaddubsw, or the portable build: the same bits), against a
float64 reference of that arithmetic; and clear errors for what cannot be packed."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from helpers.dense_isa import ISAS, pinned_dense_isa
from helpers.random_blocks import random_blocks

from pyengine import _C, ops
from pyengine.layers.block_quantized import BLOCK, BlockQuantized
from pyengine.layers.quantization.packing import pack_block_quantized


@pytest.fixture(params=ISAS, autouse=True)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test in each build of the widening this CPU can run."""
    yield from pinned_dense_isa(request.param)


FORMS = [(4, "q4_1"), (4, "q4_0"), (8, "q8_0"), (8, "q6_k")]


def float_packed(w: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    out_features, in_features = w.shape
    n = out_features // 2 if gate_up else out_features
    packed = torch.empty((2 if gate_up else 1) * _C.packed_weight_size(in_features, n))
    (_C.pack_gate_up_weight if gate_up else _C.pack_weight)(packed, w.t().contiguous())
    return packed


@pytest.mark.parametrize(("bits", "form"), FORMS)
@pytest.mark.parametrize(
    ("m", "k", "n"),
    # up to a prefill's many rows, past one block of rows (kBlockFloats / k)
    [
        (1, 32, 50),
        (1, 1536, 60),
        (2, 576, 49),
        (3, 96, 100),
        (4, 1536, 97),
        (5, 192, 60),  # AVX-512's register rows: a token and 4 or 5 drafts
        (6, 576, 97),
        (7, 96, 50),
        (8, 576, 49),
        (21, 160, 97),
        (130, 64, 60),
        (1100, 96, 50),
    ],  # fmt: skip
)
def test_dense_of_blocks_is_the_float32_dense_of_the_widened_weight(
    bits: int, form: str, m: int, k: int, n: int, isa: str
) -> None:
    blocks = random_blocks(n, k, bits, form)
    w = torch.from_numpy(blocks.dequantize())
    x, bias = torch.randn(m, k), torch.randn(n)
    got, want = torch.empty(m, n), torch.empty(m, n)
    ops.dense(got, x, pack_block_quantized(blocks), bias, n)
    ops.dense(want, x, float_packed(w), bias, n)
    assert torch.equal(got, want)  # every build, every row count
    reference = x.double() @ w.double().t() + bias.double()
    assert (got - reference).abs().max() < 1e-4 * max(1.0, reference.abs().max().item())


@pytest.mark.parametrize(("bits", "form"), FORMS)
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [(1, 64, 40), (2, 576, 60), (4, 96, 49), (5, 192, 100), (6, 96, 60), (16, 576, 70)],
)
def test_gated_dense_of_blocks_is_the_float32_one(
    bits: int, form: str, m: int, k: int, n: int
) -> None:
    blocks = random_blocks(2 * n, k, bits, form)
    w = torch.from_numpy(blocks.dequantize())
    x = torch.randn(m, k)
    got, want = torch.empty(m, n), torch.empty(m, n)
    ops.dense_silu_and_mul(got, x, pack_block_quantized(blocks, gate_up=True), n)
    ops.dense_silu_and_mul(want, x, float_packed(w, gate_up=True), n)
    assert torch.equal(got, want)


def int8_rows_reference(x: torch.Tensor, blocks: BlockQuantized) -> torch.Tensor:
    """x's rows quantized per block of 32 as the kernel does (d = max|x| / 127 and
    round(x / d) in float32, ties to even), then, per group of the weight, the exact
    integer sum of q * xq times scale * d, plus offset times the sum of x: in float64."""
    xs = x.numpy()
    rows, k = xs.shape
    blocks_x = xs.reshape(rows, k // BLOCK, BLOCK)
    d = (np.abs(blocks_x).max(axis=2) / np.float32(127)).astype(np.float32)
    safe = np.where(d > 0, d, np.float32(1))[..., None]
    xq = np.clip(np.rint(blocks_x / safe), -127, 127).astype(np.int64).reshape(rows, k)
    group = blocks.group
    q = blocks.q.astype(np.int64)  # [n, k]
    scale_d = blocks.scale.astype(np.float32)[None] * np.repeat(d, BLOCK // group, axis=1)[:, None]
    dots = np.einsum("rgi,ngi->rng", xq.reshape(rows, -1, group), q.reshape(len(q), -1, group))
    x_sums = xs.astype(np.float64).reshape(rows, -1, group).sum(axis=2)  # [rows, groups]
    out = (dots * scale_d.astype(np.float32).astype(np.float64)).sum(axis=2)
    out += (blocks.offset.astype(np.float64)[None] * x_sums[:, None]).sum(axis=2)
    return torch.from_numpy(out)


@pytest.mark.parametrize(("bits", "form"), FORMS)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 32, 50), (1, 1536, 60), (2, 576, 49),
                                           (3, 96, 100), (4, 1536, 97), (7, 64, 48),
                                           (130, 96, 50)])  # fmt: skip
def test_int8_activations_multiply_in_integers(
    bits: int, form: str, m: int, k: int, n: int
) -> None:
    blocks = random_blocks(n, k, bits, form)
    x = torch.randn(m, k)
    if k > BLOCK:
        x[0, :BLOCK] = 0.0  # a block of zeros: d 0
    got = torch.empty(m, n)
    ops.dense(got, x, pack_block_quantized(blocks), None, n, int8_activations=True)
    want = int8_rows_reference(x, blocks)
    terms = int8_rows_reference(x.abs(), BlockQuantized(
        np.abs(blocks.q.astype(np.int16)).astype(blocks.q.dtype), np.abs(blocks.scale),
        np.abs(blocks.offset)))  # fmt: skip
    error = (got.double() - want).abs()
    assert (error <= 1e-5 * terms + 1e-30).all(), error.max()
    # and not the float product: x's rounding to 8 bits shows
    exact = x.double() @ torch.from_numpy(blocks.dequantize()).double().t()
    assert (got.double() - exact).abs().max() > 100 * error.max()


@pytest.mark.parametrize(("bits", "form"), FORMS)
@pytest.mark.parametrize("m", [1, 3, 9])
def test_int8_activations_are_the_same_bits_in_every_build(bits: int, form: str, m: int) -> None:
    blocks = random_blocks(100, 576, bits, form)
    x = torch.randn(m, 576)
    packed, gate_up = pack_block_quantized(blocks), pack_block_quantized(blocks, gate_up=True)
    results = []
    for isa in ISAS:
        _C.set_quantized_dense_isa(isa)
        out, gated = torch.empty(m, 100), torch.empty(m, 50)
        ops.dense(out, x, packed, None, 100, int8_activations=True)
        ops.dense_silu_and_mul(gated, x, gate_up, 50, int8_activations=True)
        results.append((out, gated))
    for out, gated in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(gated, results[0][1])
    product = torch.empty(m, 100)
    ops.dense(product, x, packed, None, 100, int8_activations=True)
    want = torch.empty(m, 50)
    ops.silu_and_mul(want, torch.cat([product[:, :50], product[:, 50:]], dim=1))
    assert torch.equal(results[0][1], want)


def test_int8_activations_of_a_non_finite_row_are_nan() -> None:
    blocks = random_blocks(50, 96, 4, "q4_1")
    x = torch.randn(3, 96)
    x[0, 5], x[1, 70] = float("inf"), float("nan")
    out = torch.empty(3, 50)
    ops.dense(out, x, pack_block_quantized(blocks), None, 50, int8_activations=True)
    assert out[:2].isnan().all() and out[2].isfinite().all()


def test_int8_activations_leave_fp8_weights_float() -> None:
    """fp8 weights take the widened float product (int8 activations are for integers)."""
    x = torch.randn(5, 96)
    got, want = torch.empty(5, 60), torch.empty(5, 60)
    w = torch.randn(60, 96).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 60) + 0.5
    packed = torch.empty(_C.packed_quantized_weight_size(96, 60, 8), dtype=torch.float8_e4m3fn)
    _C.pack_quantized_weight(packed, w.t().contiguous(), scale, torch.zeros(3, 60), False)
    for rows in (1, 5):
        ops.dense(got[:rows], x[:rows], packed, None, 60, int8_activations=True)
        ops.dense(want[:rows], x[:rows], packed, None, 60)
        assert torch.equal(got[:rows], want[:rows])


@pytest.mark.parametrize(("bits", "form"), [*FORMS, (32, "float32")])
@pytest.mark.parametrize(("k", "n"), [(32, 48), (96, 100), (576, 49)])
def test_packed_columns_are_the_weights_rows(bits: int, form: str, k: int, n: int) -> None:
    """An embedding looked up in its head's packed form: row v of the [n, k] weight,
    exactly (the widened values)."""
    blocks = random_blocks(n, k, 4 if bits == 32 else bits, "q4_1" if bits == 32 else form)
    w = torch.from_numpy(blocks.dequantize())
    packed = float_packed(w) if bits == 32 else pack_block_quantized(blocks)
    ids = torch.tensor([0, n - 1, n // 2, 0, 7 % n])
    out = torch.empty(len(ids), k)
    ops.packed_columns(out, packed, ids, n)
    assert torch.equal(out, w[ids])
    with pytest.raises(ValueError, match=r"ids\[1\] is -1, outside \[0, "):
        ops.packed_columns(out[:2], packed, torch.tensor([0, -1]), n)
    narrow = torch.empty_like(out)
    ops.packed_columns(narrow, packed, ids.to(torch.int32), n)  # (the step's own ids)
    assert torch.equal(narrow, out)
    with pytest.raises(ValueError, match="ids must be int32 or int64"):
        ops.packed_columns(out[:2], packed, torch.tensor([0, 1], dtype=torch.int8), n)


def test_widening_rounds_as_the_loader_dequantizes() -> None:
    """q * scale + offset in float32, one rounding (q * scale is exact): the product of x
    with a unit row picks the widened weights out exactly."""
    blocks = random_blocks(48, 64, 4, "q4_1")
    eye = torch.eye(64)
    got = torch.empty(64, 48)
    for rows in (1, 8):  # the one-row kernel and the tiles
        for r0 in range(0, 64, rows):
            ops.dense(
                got[r0 : r0 + rows], eye[r0 : r0 + rows], pack_block_quantized(blocks), None, 48
            )
        assert torch.equal(got.t(), torch.from_numpy(blocks.dequantize()))


def test_stacked_blocks_of_mixed_bits_are_8_bit() -> None:
    a, b = random_blocks(10, 64, 4, "q4_1"), random_blocks(6, 64, 8, "q8_0")
    whole = BlockQuantized.stack([a, b])
    assert whole.bits == 8 and whole.shape == (16, 64)
    assert (whole.dequantize()[:10] == a.dequantize()).all()
    assert (whole.dequantize()[10:] == b.dequantize()).all()
    # with Q6_K's parts (q/k with v, as Q4_K_M files mix them): groups of 16 for all
    c = random_blocks(5, 64, 8, "q6_k")
    whole = BlockQuantized.stack([a, c])
    assert whole.group == 16 and whole.scale.shape == (15, 4)
    assert (whole.dequantize()[:10] == a.dequantize()).all()
    assert (whole.dequantize()[10:] == c.dequantize()).all()
    x, got, want = torch.randn(3, 64), torch.empty(3, 15), torch.empty(3, 15)
    ops.dense(got, x, pack_block_quantized(whole), None, 15)
    ops.dense(want, x, float_packed(torch.from_numpy(whole.dequantize())), None, 15)
    assert torch.equal(got, want)


def test_empty_operands() -> None:
    blocks = random_blocks(50, 64, 4, "q4_1")
    out = torch.empty(0, 50)
    ops.dense(out, torch.randn(0, 64), pack_block_quantized(blocks), None, 50)
    assert out.shape == (0, 50)


def test_quantized_packing_errors() -> None:
    q = torch.randint(0, 16, (64, 50), dtype=torch.uint8)
    scale = torch.full((2, 50), 0.25)
    offset = torch.zeros(2, 50)
    packed = torch.empty(_C.packed_quantized_weight_size(64, 50, 4), dtype=torch.uint8)
    _C.pack_quantized_weight(packed, q, scale, offset)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        _C.packed_quantized_weight_size(64, 50, 5)
    with pytest.raises(ValueError, match="k must be a multiple of 32"):
        _C.packed_quantized_weight_size(40, 50, 4)
    with pytest.raises(ValueError, match="must be uint8 .4-bit weights., int8 .8-bit. or float8"):
        _C.pack_quantized_weight(torch.empty(packed.numel()), q, scale, offset)
    with pytest.raises(ValueError, match="q_t must be int8"):
        _C.pack_quantized_weight(packed.view(torch.int8), q, scale, offset)
    with pytest.raises(ValueError, match=r"q_t's rows. must be a multiple of 32"):
        _C.pack_quantized_weight(packed, q[:40], scale, offset)
    with pytest.raises(ValueError, match=r"scale_t must be \[2, 50\]"):
        _C.pack_quantized_weight(packed, q, scale[:1], offset)
    with pytest.raises(ValueError, match=r"offset_t must be float32"):
        _C.pack_quantized_weight(packed, q, scale, offset.int())
    with pytest.raises(ValueError, match="holds values 0..15, row 3 has more"):
        bad = q.clone()
        bad[3, 7] = 16
        _C.pack_quantized_weight(packed, bad, scale, offset)
    # Where an offset is not zero, q * scale must be exact: 20 bits do for 4-bit q (a
    # K-quant's float16 times a 6-bit integer has at most 17), 18 not for 8-bit. Without
    # an offset any scale does (one rounding either way).
    with_offset = offset.clone()
    with_offset[1, 3] = 0.5
    with pytest.raises(ValueError, match="at most 20 significant bits for 4-bit q with an offset"):
        _C.pack_quantized_weight(packed, q, scale + 1e-6, with_offset)
    _C.pack_quantized_weight(packed, q, scale + 1e-6, offset)
    twenty = torch.full((2, 50), 1 + 2.0**-19)
    _C.pack_quantized_weight(packed, q, twenty, with_offset)
    packed8 = torch.empty(_C.packed_quantized_weight_size(64, 50, 8), dtype=torch.int8)
    with pytest.raises(ValueError, match="at most 17 significant bits for 8-bit q"):
        _C.pack_quantized_weight(
            packed8, q.view(torch.int8), torch.full((2, 50), 1 + 2.0**-17), with_offset
        )
    with pytest.raises(ValueError, match=r"packed must be dense \["):
        _C.pack_quantized_weight(packed[:-1], q, scale, offset)
    with pytest.raises(ValueError, match=r"q_t must be \[k, 2n\]"):
        _C.pack_quantized_weight(packed, q[:, :49], scale[:, :49], offset[:, :49], True)
    with pytest.raises(ValueError, match="needs k .x's columns. a multiple of 32"):
        ops.dense(torch.empty(2, 50), torch.randn(2, 40), packed, None, 50)
    with pytest.raises(ValueError, match="packed must be a packed"):
        ops.dense(torch.empty(2, 50), torch.randn(2, 96), packed, None, 50)
    with pytest.raises(ValueError, match="packed must be a packed"):  # 8-bit size, 4-bit data
        ops.dense(torch.empty(2, 50), torch.randn(2, 64), packed.view(torch.int8), None, 50)


@pytest.mark.parametrize(
    ("bits", "form", "params", "bytes_a_weight"),
    [(4, "q4_1", "float16", 0.625), (4, "q4_0", "float16", 0.625),
     (8, "q8_0", "scale_float16", 1.0625), (8, "q6_k", "float32", 1.5)],
)  # fmt: skip
def test_float16_parameters_where_they_hold_the_blocks_exactly(
    bits: int, form: str, params: str, bytes_a_weight: float
) -> None:
    """GGUF's legacy types' scales (and offsets) are float16s: packed as such, a weight
    takes an eighth of a byte less (Q8_0's zero offsets, none at all); K-quants' are not."""
    blocks = random_blocks(96, 256, bits, form)
    packed = pack_block_quantized(blocks)
    assert packed.numel() == 2 * 256 * 48 * bytes_a_weight  # (96 columns: two panels)
    x = torch.randn(3, 256)
    got, want = torch.empty(3, 96), torch.empty(3, 96)
    ops.dense(got, x, packed, None, 96)
    ops.dense(want, x, float_packed(torch.from_numpy(blocks.dequantize())), None, 96)
    assert torch.equal(got, want)
    q_t, scale_t, offset_t = (
        torch.from_numpy(np.ascontiguousarray(a.T)) for a in (blocks.q, blocks.scale, blocks.offset)
    )
    assert _C.narrowest_quant_params(q_t, scale_t, offset_t) == params


def test_narrower_parameters_than_the_blocks_need_are_refused() -> None:
    q = torch.randint(0, 16, (64, 50), dtype=torch.uint8)
    scale, offset = torch.full((2, 50), 0.25), torch.full((2, 50), -2.0)
    assert _C.narrowest_quant_params(q, scale, offset) == "float16"
    assert _C.narrowest_quant_params(q, scale, offset * 0) == "scale_float16"
    assert _C.narrowest_quant_params(q, scale + 2.0**-20, offset) == "float32"
    assert _C.narrowest_quant_params(q, scale, offset + 2.0**-20) == "float32"
    size = _C.packed_quantized_weight_size(64, 50, 4, 32, "scale_float16")
    packed = torch.empty(size, dtype=torch.uint8)
    with pytest.raises(ValueError, match="offset_t holds a value that its parameters"):
        _C.pack_quantized_weight(packed, q, scale, offset, False, "scale_float16")
    packed = torch.empty(
        _C.packed_quantized_weight_size(64, 50, 4, 32, "float16"), dtype=torch.uint8
    )
    with pytest.raises(ValueError, match="scale_t holds a value that is not a float16"):
        _C.pack_quantized_weight(packed, q, scale + 2.0**-20, offset, False, "float16")
    with pytest.raises(ValueError, match="params must be 'float32', 'float16', 'scale_float16' or"):
        _C.packed_quantized_weight_size(64, 50, 4, 32, "bfloat16")
    with pytest.raises(ValueError, match="groups of 16 rows take float32 params"):
        _C.packed_quantized_weight_size(64, 50, 8, 16, "float16")
    size = _C.packed_quantized_weight_size(64, 50, 4, 32, "scale_float32")
    with pytest.raises(ValueError, match="only they take float32 scales alone"):
        _C.pack_quantized_weight(
            torch.empty(size, dtype=torch.uint8), q, scale, offset * 0, False, "scale_float32"
        )
