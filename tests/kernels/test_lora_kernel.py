"""ops.lora_add and ops.lora_embedding_add, the CPU's batched LoRA
(cpp/include/pyengine/lora.h), against float64 torch on fresh random inputs: rows of
several slots interleaved with rows of none, one part and stacked parts (q/k/v's uneven
columns), odd sizes, float32 and bfloat16 (each delta rounded once into the bfloat16
product); rows without an adapter left bit for bit; bad arguments refused by name,
before anything is written."""

from __future__ import annotations

import pytest
import torch

from pyengine import built_with_cuda, ops


def case(
    tokens: int, k: int, columns: list[int], rank: int, slots: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    parts = len(columns)
    n = sum(columns)
    x = torch.randn(tokens, k).to(dtype)
    out = torch.randn(tokens, n).to(dtype)
    a = (torch.randn(slots, parts * rank, k) / k**0.5).to(dtype)
    b = torch.zeros(slots, parts * rank, n)
    start = 0
    for p, width in enumerate(columns):  # part p's ranks over its own columns only
        b[:, p * rank : (p + 1) * rank, start : start + width] = torch.randn(slots, rank, width)
        start += width
    token_slots = torch.randint(-1, slots, (tokens,), dtype=torch.int32)
    scale = torch.rand(slots) + 0.5
    part_columns = torch.tensor([0, *torch.tensor(columns).cumsum(0).tolist()], dtype=torch.int64)
    return out, x, a, b.to(dtype), token_slots, scale, part_columns


def reference(out, x, a, b, token_slots, scale, part_columns) -> torch.Tensor:  # type: ignore[no-untyped-def]
    want = out.double().clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            want[t] += scale[s].double() * (x[t].double() @ a[s].double().T) @ b[s].double()
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "k", "columns", "rank", "slots"),
    [(1, 64, [96], 8, 1), (37, 576, [576, 192, 192], 16, 4), (13, 100, [50, 31], 4, 3),
     (64, 1536, [576], 64, 2), (9, 17, [5, 6, 7], 1, 5)],
)  # fmt: skip
def test_lora_add_is_each_rows_delta(
    dtype: torch.dtype, tokens: int, k: int, columns: list[int], rank: int, slots: int
) -> None:
    args = case(tokens, k, columns, rank, slots, dtype)
    out, token_slots = args[0], args[4]
    before = out.clone()
    want = reference(*args)
    ops.lora_add(*args)
    none = token_slots < 0
    assert torch.equal(out[none], before[none])  # rows without an adapter untouched
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
    else:  # the delta in float32, rounded once with the product to bfloat16
        torch.testing.assert_close(out.double(), want, rtol=8e-3, atol=2e-2)


def test_lora_add_refuses_bad_arguments_by_name() -> None:
    out, x, a, b, token_slots, scale, columns = case(5, 32, [16, 8], 4, 2, torch.float32)
    before = out.clone()
    good = (out, x, a, b, token_slots, scale, columns)

    def with_(index: int, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(value if i == index else arg for i, arg in enumerate(good))

    bad = {
        "lora_add: slots\\[1\\] is 7": with_(4, torch.tensor([0, 7, 0, 0, 0], dtype=torch.int32)),
        "lora_add: b must be \\[2, 8, 24\\]": with_(3, b[:, :, :20].contiguous()),
        "lora_add: a must be \\[slots, ranks, 32\\]": with_(2, a[:, :, :31].contiguous()),
        "lora_add: part_columns must be int64": with_(6, torch.tensor([0, 10, 20])),
        "lora_add: x must be float32": with_(1, x.half()),
        "lora_add: out must be float32 or bfloat16": with_(0, out.half()),
    }
    for message, args in bad.items():
        with pytest.raises(ValueError, match=message):
            ops.lora_add(*args)
    assert torch.equal(out, before)


def embedding_case(
    tokens: int, vocab: int, n: int, rank: int, slots: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    out = torch.randn(tokens, n).to(dtype)
    ids = torch.randint(0, vocab, (tokens,))
    a_t = torch.randn(slots, vocab, rank).to(dtype)
    b_t = (torch.randn(slots, rank, n) / rank**0.5).to(dtype)
    token_slots = torch.randint(-1, slots, (tokens,), dtype=torch.int32)
    return out, ids, a_t, b_t, token_slots, torch.rand(slots) + 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "vocab", "n", "rank", "slots"),
    [(1, 50, 64, 8, 1), (37, 1000, 576, 16, 4), (9, 7, 17, 1, 3), (64, 300, 100, 64, 2)],
)
def test_lora_embedding_add_is_each_tokens_delta(
    dtype: torch.dtype, tokens: int, vocab: int, n: int, rank: int, slots: int
) -> None:
    out, ids, a_t, b_t, token_slots, scale = embedding_case(tokens, vocab, n, rank, slots, dtype)
    before = out.clone()
    want = out.double().clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:  # the one-hot row's shrink is A's column of the token
            want[t] += scale[s].double() * a_t[s, ids[t]].double() @ b_t[s].double()
    ops.lora_embedding_add(out, ids, a_t, b_t, token_slots, scale)
    none = token_slots < 0
    assert torch.equal(out[none], before[none])
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(out.double(), want, rtol=8e-3, atol=2e-2)


def test_lora_embedding_add_refuses_bad_arguments_by_name() -> None:
    out, ids, a_t, b_t, token_slots, scale = embedding_case(5, 40, 24, 4, 2, torch.float32)
    before = out.clone()
    good = (out, ids, a_t, b_t, token_slots, scale)

    def with_(index: int, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(value if i == index else arg for i, arg in enumerate(good))

    bad = {
        "lora_embedding_add: ids\\[2\\] is 40, outside \\[0, 40\\)": with_(
            1, torch.tensor([0, 1, 40, 2, 3])
        ),
        "lora_embedding_add: slots\\[0\\] is 2": with_(
            4, torch.tensor([2, 0, 0, 0, 0], dtype=torch.int32)
        ),
        "lora_embedding_add: b must be \\[2, 4, 24\\]": with_(3, b_t[:, :3].contiguous()),
        "lora_embedding_add: ids must be int32 or int64 \\[5\\]": with_(1, ids[:4]),
        "lora_embedding_add: a must be float32": with_(2, a_t.half()),
        "lora_embedding_add: scale must be dense float32 \\[2\\]": with_(5, scale[:1]),
    }
    for message, args in bad.items():
        with pytest.raises(ValueError, match=message):
            ops.lora_embedding_add(*args)
    assert torch.equal(out, before)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and built_with_cuda()),
    reason="needs a CUDA GPU and pyengine built with CUDA",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lora_add_on_the_gpu(dtype: torch.dtype) -> None:
    args = case(37, 576, [576, 192, 192], 16, 4, torch.float32)
    args = tuple(t.to(dtype) if t.is_floating_point() and t.ndim > 1 else t for t in args)
    want = reference(*args)
    on_gpu = [t if i == 6 else t.cuda() for i, t in enumerate(args)]  # part_columns: CPU
    ops.lora_add(*on_gpu)
    tolerance = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(on_gpu[0].cpu().double(), want, rtol=tolerance, atol=tolerance)
