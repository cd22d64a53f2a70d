"""The mixture-of-experts layer on CUDA (GroupedExperts: pyengine's softmax top-k, the
slots aligned by expert, the grouped gate/up and down products on tensor cores, the
combine) against the float64 reference of its routed and shared experts, for every
routing variant, float16 and bfloat16; the CUDA top-k against the CPU's; a whole layer
captured in a CUDA graph and replayed. Runs where a GPU and a CUDA build are present
(bench/gpu/run.sh); the kernels themselves run on the host in cpp/tests/test_cuda_moe.cpp."""

from __future__ import annotations

import pytest
import torch
from helpers.moe_layers import (
    ROUTINGS,
    TOLERANCE,
    random_layer,
    reference_output,
    unambiguous_tokens,
)

from pyengine import built_with_cuda, ops
from pyengine.layers.moe.methods import GroupedExperts, experts_method
from pyengine.layers.placement import Placement

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and built_with_cuda()), reason="needs a GPU and a CUDA build"
)


@pytest.fixture(autouse=True)
def grouped_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """(opt-in until they have run on a GPU)"""
    monkeypatch.setenv("PYENGINE_CUDA_MOE_KERNELS", "1")


def test_the_kernels_are_chosen_on_cuda_in_16_bits() -> None:
    for dtype, grouped in ((torch.bfloat16, True), (torch.float16, True), (torch.float32, False)):
        placement = Placement(dtype=dtype, device=torch.device("cuda"))
        assert isinstance(experts_method(placement), GroupedExperts) == grouped


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_top_k_is_the_cpus(dtype: torch.dtype) -> None:
    logits = torch.randn(37, 64).to(dtype)
    want_ids = torch.empty(37, 6, dtype=torch.int32)
    want_weights = torch.empty(37, 6)
    ops.moe_softmax_topk(want_ids, want_weights, logits.float(), True)
    ids = torch.empty(37, 6, dtype=torch.int32, device="cuda")
    weights = torch.empty(37, 6, device="cuda")
    ops.moe_softmax_topk(ids, weights, logits.cuda(), True)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_weights, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shared", ["", "gated"])
def test_the_grouped_layer_is_its_routed_and_shared_experts(
    routing: str, dtype: torch.dtype, shared: str
) -> None:
    config = ROUTINGS[routing]
    layer, w = random_layer(config, dtype, shared, device="cuda")
    assert isinstance(layer.method, GroupedExperts)
    for count in (1, 9, 70):  # (a decode row; rows that leave experts idle; many a block)
        x = unambiguous_tokens(count, w["router"], config, dtype)
        want = reference_output(x, w, config)
        got = layer(x.cuda())
        assert got.dtype == dtype and got.shape == x.shape
        error = (got.double().cpu() - want).abs().max().item()
        assert error <= TOLERANCE[dtype] * want.abs().max().item(), count


def test_a_captured_layer_replays_its_eager_output() -> None:
    config = ROUTINGS["softmax"]
    layer, w = random_layer(config, torch.bfloat16, "gated", device="cuda")
    x = unambiguous_tokens(8, w["router"], config, torch.bfloat16).cuda()
    eager = layer(x)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x)  # (a warm-up on the side stream, as capture asks)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = layer(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
