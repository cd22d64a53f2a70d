"""The recurrent-state kernels (pyengine/recurrent.h) against float64 references token by
token: Gated DeltaNet's gated delta rule, Mamba-2's scan and the short causal
convolution, over mixed steps (new requests and ones continuing from their state slots,
one token or many), in each instruction-set build; a request split across calls gives
one call's results; bad arguments are clear errors that write nothing; the CUDA kernels
give the CPU ones' results (on a GPU)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from helpers.dense_isa import ISAS

from pyengine import _C, built_with_cuda


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    _C.set_attention_isa(request.param)
    yield request.param
    _C.set_attention_isa("auto")


@pytest.fixture(params=["tokens", "chunks"])
def form(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each run token by token, or a chunk (64 tokens) at a time: the lengths below both
    divide into chunks and leave a partial one."""
    _C.set_recurrent_chunks_from(1 if request.param == "chunks" else 1 << 40)
    yield request.param
    _C.set_recurrent_chunks_from(0)


def delta_reference(q, k, v, g, beta, state, scale, normalize):  # type: ignore[no-untyped-def]
    """One request's tokens, float64: out [T, Hv, dv] and the final state [Hv, dk, dv]."""
    q, k, v, g, beta, s = (x.double() for x in (q, k, v, g, beta, state))
    s = s.clone()
    per = v.shape[1] // q.shape[1]
    out = torch.zeros_like(v)
    for t in range(q.shape[0]):
        for h in range(v.shape[1]):
            qt, kt = q[t, h // per], k[t, h // per]
            if normalize:
                qt = qt / torch.sqrt((qt * qt).sum() + 1e-6)
                kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
            s[h] = s[h] * torch.exp(g[t, h])
            delta = beta[t, h] * (v[t, h] - s[h].T @ kt)
            s[h] = s[h] + torch.outer(kt, delta)
            out[t, h] = s[h].T @ (qt * scale)
    return out, s


def conv_reference(x, weight, bias, state, silu):  # type: ignore[no-untyped-def]
    """One request's tokens, float64: out [T, C] and the final state [C, K - 1]."""
    width = weight.shape[1]
    seq = torch.cat((state.double().T, x.double()), dim=0)  # [K - 1 + T, C]
    out = torch.stack([(seq[t : t + width].T * weight.double()).sum(1) for t in range(x.shape[0])])
    if bias is not None:
        out = out + bias.double()
    if silu:
        out = out * torch.sigmoid(out)
    return out, seq[seq.shape[0] - (width - 1) :].T


def ssm_reference(x, dt, a, b, c, d, dt_bias, state, softplus, limits):  # type: ignore[no-untyped-def]
    """One request's tokens, float64: out [T, H, P] and the final state [H, P, N]."""
    x, dt, a, b, c, s = (t.double() for t in (x, dt, a, b, c, state))
    s = s.clone()
    per = x.shape[1] // b.shape[1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            step = dt[t, h] + (dt_bias[h].double() if dt_bias is not None else 0.0)
            if softplus:
                step = torch.nn.functional.softplus(step)
            step = step.clamp(*limits)
            s[h] = s[h] * torch.exp(step * a[h]) + step * torch.outer(x[t, h], b[t, h // per])
            out[t, h] = s[h] @ c[t, h // per] + (d[h].double() * x[t, h] if d is not None else 0)
    return out, s


def requests(rng: np.random.Generator, lengths: list[int], num_slots: int):  # type: ignore[no-untyped-def]
    slots = rng.permutation(num_slots)[: len(lengths)].astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    has = rng.integers(0, 2, len(lengths)).astype(np.int32)
    return torch.from_numpy(slots), torch.from_numpy(has), torch.from_numpy(qsl)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize(("hk", "hv", "dk", "dv"), [(2, 4, 16, 32), (1, 3, 12, 20)])
def test_gated_delta_rule_matches_the_float64_recurrence(
    isa: str, form: str, normalize: bool, hk: int, hv: int, dk: int, dv: int
) -> None:
    rng = np.random.default_rng()
    lengths = [1, 5, 17, 1, 64, 150]
    slots, has, qsl = requests(rng, lengths, num_slots=8)
    t = int(qsl[-1])
    q, k = torch.randn(t, hk, dk), torch.randn(t, hk, dk)
    if not normalize:  # (keys of small norm keep the recurrence stable)
        q, k = q / dk, k / dk
    v = torch.randn(t, hv, dv)
    g = -torch.rand(t, hv)  # (decays in (1/e, 1])
    beta = torch.rand(t, hv)
    state = torch.randn(8, hv, dk, dv) * 0.1
    before = state.clone()
    out = torch.full((t, hv, dv), float("nan"))
    scale = dk**-0.5
    _C.gated_delta_rule(out, q, k, v, g, beta, state, slots, has, qsl, scale, normalize)
    for r, slot in enumerate(slots.tolist()):
        rows = slice(int(qsl[r]), int(qsl[r + 1]))
        start = before[slot] if has[r] else torch.zeros(hv, dk, dv)
        want, final = delta_reference(q[rows], k[rows], v[rows], g[rows], beta[rows], start,
                                      scale, normalize)  # fmt: skip
        assert torch.allclose(out[rows].double(), want, atol=1e-4, rtol=1e-4), r
        assert torch.allclose(state[slot].double(), final, atol=1e-4, rtol=1e-4), r
    unused = [s for s in range(8) if s not in slots.tolist()]
    assert torch.equal(state[unused], before[unused])


@pytest.mark.parametrize("width", [4, 2, 1])
@pytest.mark.parametrize("with_bias", [True, False])
def test_causal_conv1d_matches_the_float64_convolution(
    isa: str, width: int, with_bias: bool
) -> None:
    rng = np.random.default_rng()
    lengths = [1, 2, 9, 1, 33]
    slots, has, qsl = requests(rng, lengths, num_slots=7)
    t, c = int(qsl[-1]), 37
    x, weight = torch.randn(t, c), torch.randn(c, width)
    bias = torch.randn(c) if with_bias else None
    state = torch.randn(7, c, width - 1)
    before = state.clone()
    for silu in (True, False):
        state.copy_(before)
        out = torch.full((t, c), float("nan"))
        _C.causal_conv1d(out, x, weight, bias, state, slots, has, qsl, silu)
        for r, slot in enumerate(slots.tolist()):
            rows = slice(int(qsl[r]), int(qsl[r + 1]))
            start = before[slot] if has[r] else torch.zeros(c, width - 1)
            want, final = conv_reference(x[rows], weight, bias, start, silu)
            assert torch.allclose(out[rows].double(), want, atol=1e-5), (r, silu)
            assert torch.allclose(state[slot].double(), final, atol=1e-6), (r, silu)


@pytest.mark.parametrize(("heads", "groups", "p", "n"), [(4, 2, 8, 16), (3, 1, 5, 12)])
@pytest.mark.parametrize("extras", [True, False])
def test_ssm_scan_matches_the_float64_recurrence(
    isa: str, form: str, heads: int, groups: int, p: int, n: int, extras: bool
) -> None:
    """With D and dt_bias, softplus and a clamp of the step (extras), or none of them."""
    rng = np.random.default_rng()
    lengths = [1, 6, 19, 1, 128, 131]
    slots, has, qsl = requests(rng, lengths, num_slots=9)
    t = int(qsl[-1])
    x, b, c = torch.randn(t, heads, p), torch.randn(t, groups, n), torch.randn(t, groups, n)
    dt = torch.randn(t, heads) if extras else torch.rand(t, heads)
    a = -torch.rand(heads) * 2
    d = torch.randn(heads) if extras else None
    dt_bias = torch.randn(heads) if extras else None
    limits = (0.05, 2.0) if extras else (0.0, float("inf"))
    state = torch.randn(9, heads, p, n)
    before = state.clone()
    out = torch.full((t, heads, p), float("nan"))
    _C.ssm_scan(out, x, dt, a, b, c, d, dt_bias, state, slots, has, qsl, extras, *limits)
    for r, slot in enumerate(slots.tolist()):
        rows = slice(int(qsl[r]), int(qsl[r + 1]))
        start = before[slot] if has[r] else torch.zeros(heads, p, n)
        want, final = ssm_reference(x[rows], dt[rows], a, b[rows], c[rows], d, dt_bias, start,
                                    extras, limits)  # fmt: skip
        assert torch.allclose(out[rows].double(), want, atol=1e-4, rtol=1e-4), r
        assert torch.allclose(state[slot].double(), final, atol=1e-4, rtol=1e-4), r
    unused = [s for s in range(9) if s not in slots.tolist()]
    assert torch.equal(state[unused], before[unused])


def test_a_request_split_across_calls_gives_one_calls_results(form: str) -> None:
    """A prefill in two chunks, then decode steps, continue through the state slots as
    one call over all the tokens does (the engine's chunked prefill and decoding)."""
    torch.manual_seed(0)
    hk, hv, dk, dv, c, width, t = 2, 4, 16, 16, 24, 4, 94
    q, k, v = torch.randn(t, hk, dk), torch.randn(t, hk, dk), torch.randn(t, hv, dv)
    g, beta, x = -torch.rand(t, hv), torch.rand(t, hv), torch.randn(t, c)
    weight = torch.randn(c, width)
    heads, p, size = 4, 6, 8
    xs, dts = torch.randn(t, heads, p), torch.randn(t, heads)
    bs, cs, a = torch.randn(t, 2, size), torch.randn(t, 2, size), -torch.rand(heads)

    def run(pieces: list[int]):  # type: ignore[no-untyped-def]
        state, conv_state = torch.zeros(3, hv, dk, dv), torch.zeros(3, c, width - 1)
        ssm_state = torch.zeros(3, heads, p, size)
        outs, conv_outs, ssm_outs, start = [], [], [], 0
        for i, n in enumerate(pieces):
            rows = slice(start, start + n)
            slot, has = (
                torch.tensor([2], dtype=torch.int32),
                torch.tensor([int(i > 0)], dtype=torch.int32),
            )
            qsl = torch.tensor([0, n], dtype=torch.int32)
            out, conv_out = torch.empty(n, hv, dv), torch.empty(n, c)
            _C.gated_delta_rule(out, q[rows], k[rows], v[rows], g[rows], beta[rows], state, slot,
                                has, qsl, 0.25, True)  # fmt: skip
            _C.causal_conv1d(conv_out, x[rows], weight, None, conv_state, slot, has, qsl, True)
            ssm_out = torch.empty(n, heads, p)
            _C.ssm_scan(ssm_out, xs[rows], dts[rows], a, bs[rows], cs[rows], None, None,
                        ssm_state, slot, has, qsl)  # fmt: skip
            outs.append(out)
            conv_outs.append(conv_out)
            ssm_outs.append(ssm_out)
            start += n
        return (torch.cat(outs), torch.cat(conv_outs), torch.cat(ssm_outs), state, conv_state,
                ssm_state)  # fmt: skip

    whole = run([t])
    split = run([12, 2, 13, 1, 1, 65])
    for a, b in zip(whole, split, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_bad_arguments_are_clear_errors() -> None:
    t, hk, hv, dk, dv = 4, 1, 2, 8, 8
    q, k, v = torch.randn(t, hk, dk), torch.randn(t, hk, dk), torch.randn(t, hv, dv)
    g, beta, out = torch.zeros(t, hv), torch.zeros(t, hv), torch.zeros(t, hv, dv)
    state = torch.zeros(2, hv, dk, dv)
    one = torch.tensor([0], dtype=torch.int32)
    qsl = torch.tensor([0, t], dtype=torch.int32)

    def call(**changed):  # type: ignore[no-untyped-def]
        args = dict(out=out, query=q, key=k, value=v, g=g, beta=beta, state=state,
                    state_slots=one, has_state=one, query_start_loc=qsl, scale=1.0,
                    normalize=True)  # fmt: skip
        args.update(changed)
        _C.gated_delta_rule(**args)

    with pytest.raises(ValueError, match="key must be"):
        call(key=torch.randn(t, hk, dk + 1))
    with pytest.raises(ValueError, match="multiple of the key heads"):
        call(query=torch.randn(t, 3, dk), key=torch.randn(t, 3, dk))
    with pytest.raises(ValueError, match="state_slots\\[0\\] is 5"):
        call(state_slots=torch.tensor([5], dtype=torch.int32))
    with pytest.raises(ValueError, match="another request's"):
        call(state_slots=torch.tensor([1, 1], dtype=torch.int32),
             has_state=torch.tensor([0, 0], dtype=torch.int32),
             query_start_loc=torch.tensor([0, 2, 4], dtype=torch.int32))  # fmt: skip
    with pytest.raises(ValueError, match="run from 0"):
        call(query_start_loc=torch.tensor([0, t - 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="float32"):
        call(value=v.half())
    with pytest.raises(ValueError, match="has_state\\[0\\] must be 0 or 1"):
        call(has_state=torch.tensor([2], dtype=torch.int32))
    assert not out.any()  # (nothing written)
    xs, dts, bc = torch.randn(t, 4, 3), torch.zeros(t, 4), torch.randn(t, 3, 2)
    ssm_state = torch.zeros(1, 4, 3, 2)
    with pytest.raises(ValueError, match="multiple of B's and C's groups"):
        _C.ssm_scan(torch.empty(t, 4, 3), xs, dts, -torch.ones(4), bc, bc, None, None, ssm_state,
                    one, one, qsl)  # fmt: skip
    b2 = torch.randn(t, 2, 2)
    with pytest.raises(ValueError, match="A must be dense float32 \\[4\\]"):
        _C.ssm_scan(torch.empty(t, 4, 3), xs, dts, -torch.ones(3), b2, b2, None, None, ssm_state,
                    one, one, qsl)  # fmt: skip
    x = torch.randn(t, 5)
    with pytest.raises(ValueError, match="state must be"):
        _C.causal_conv1d(torch.empty(t, 5), x, torch.randn(5, 4), None, torch.zeros(1, 5, 2), one,
                         one, qsl, True)  # fmt: skip
    with pytest.raises(ValueError, match="bias"):
        _C.causal_conv1d(torch.empty(t, 5), x, torch.randn(5, 4), torch.zeros(4),
                         torch.zeros(1, 5, 3), one, one, qsl, True)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(
    not (built_with_cuda() and torch.cuda.is_available()),
    reason="needs a CUDA GPU and pyengine built with CUDA",
)
def test_the_cuda_kernels_give_the_cpu_ones_results() -> None:
    """cuda/recurrent.cu (its host run: cpp/tests/test_cuda_recurrent.cpp) on the GPU, on
    a mixed step of new and continuing requests, against the CPU kernels (tested above
    against float64), through the torch ops on torch's current stream."""
    from pyengine import ops

    rng = np.random.default_rng(5)
    slots, has, qsl = requests(rng, [1, 7, 30, 1], num_slots=6)
    t, hk, hv, dk, dv, c, width = int(qsl[-1]), 2, 4, 32, 48, 40, 4
    heads, p, n = 4, 8, 16
    inputs = {
        "delta": [torch.randn(t, hk, dk), torch.randn(t, hk, dk), torch.randn(t, hv, dv),
                  -torch.rand(t, hv), torch.rand(t, hv), torch.randn(6, hv, dk, dv) * 0.1],
        "conv": [torch.randn(t, c), torch.randn(c, width), torch.randn(c),
                 torch.randn(6, c, width - 1)],
        "ssm": [torch.randn(t, heads, p), torch.randn(t, heads), -torch.rand(heads),
                torch.randn(t, 2, n), torch.randn(t, 2, n), torch.randn(heads),
                torch.randn(heads), torch.randn(6, heads, p, n)],
    }  # fmt: skip
    results = []
    for device in ("cpu", "cuda"):
        on = {name: [x.to(device) for x in xs] for name, xs in inputs.items()}
        meta = [x.to(device) for x in (slots, has, qsl)]
        q, k, v, g, beta, state = on["delta"]
        out = torch.full((t, hv, dv), float("nan"), device=device)
        ops.gated_delta_rule(out, q, k, v, g, beta, state, *meta, dk**-0.5, True)
        x, weight, bias, conv_state = on["conv"]
        conv_out = torch.full((t, c), float("nan"), device=device)
        ops.causal_conv1d(conv_out, x, weight, bias, conv_state, *meta, True)
        xs, dt, a, b, cc, d, dt_bias, ssm_state = on["ssm"]
        ssm_out = torch.full((t, heads, p), float("nan"), device=device)
        ops.ssm_scan(ssm_out, xs, dt, a, b, cc, d, dt_bias, ssm_state, *meta, True, 0.01, 2.0)
        results.append([r.cpu() for r in (out, state, conv_out, conv_state, ssm_out, ssm_state)])
    for cpu, gpu in zip(*results, strict=True):
        assert torch.allclose(gpu, cpu, atol=1e-4, rtol=1e-4), (gpu - cpu).abs().max()
