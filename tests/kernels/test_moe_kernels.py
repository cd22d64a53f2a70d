"""The mixture-of-experts kernels (cpp/src/kernels/moe.cpp): moe_softmax_topk,
moe_grouped_topk and moe_sigmoid_topk against their routing methods in torch, and
fused_experts against the float64 reference of the routed experts, for every routing
variant (softmax, DeepSeek-V3's grouped sigmoid, Llama 4's weights on the input), every
weight form (float32 and bfloat16 panels, 4- and 8-bit blocks, with and without int8
activations) and every build of the panel kernels this CPU runs; tokens routed to one
expert twice and experts no token chose; clear errors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers.dense_isa import TILE_ISAS, pinned_dense_isa
from helpers.random_blocks import random_blocks

from pyengine import ops
from pyengine.layers.moe.reference import routed_experts_reference
from pyengine.layers.moe.routing import Routing, RoutingConfig, route
from pyengine.layers.quantization.packing import pack_bf16, pack_block_quantized, pack_panels


@pytest.fixture(params=TILE_ISAS, autouse=True)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    yield from pinned_dense_isa(request.param)


def routing_of(logits: torch.Tensor, config: RoutingConfig) -> Routing:
    bias = torch.randn(config.num_experts) * 0.1 if config.method == "grouped_sigmoid" else None
    return route(logits, config, bias)


def kernel_routing(routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    return routing.expert_ids.to(torch.int32), routing.weights.float()


class Experts:
    """Random experts of one weight form: the weights the kernel multiplies by (as
    float32) and their stacked packed forms."""

    def __init__(self, form: str, experts: int, hidden: int, n: int) -> None:
        self.form, self.n = form, n
        gate_up, down = [], []
        self.gate_up = torch.empty(experts, 2 * n, hidden)
        self.down = torch.empty(experts, hidden, n)
        for e in range(experts):
            for weights, rows, columns, fused, packs in (
                (self.gate_up, 2 * n, hidden, True, gate_up),
                (self.down, hidden, n, False, down),
            ):
                if form in ("q4_0", "q8_0"):
                    blocks = random_blocks(rows, columns, 4 if form == "q4_0" else 8, form)
                    weights[e] = torch.from_numpy(blocks.dequantize())
                    packs.append(pack_block_quantized(blocks, gate_up=fused))
                    continue
                w = torch.randn(rows, columns) / columns**0.5
                if form == "bfloat16":
                    w = w.bfloat16().float()
                weights[e] = w
                pack = pack_bf16 if form == "bfloat16" else pack_panels
                packs.append(pack(w.t().contiguous(), fused))
        self.packed_gate_up, self.packed_down = torch.stack(gate_up), torch.stack(down)

    def run(
        self, x: torch.Tensor, routing: Routing, int8_activations: bool = False
    ) -> torch.Tensor:
        out = torch.empty_like(x)
        ids, weights = kernel_routing(routing)
        ops.fused_experts(
            out, x, ids, weights, self.packed_gate_up, self.packed_down, self.n,
            routing.on_input, int8_activations,
        )  # fmt: skip
        return out


ROUTINGS = {
    "softmax": RoutingConfig("softmax", 3, 8, renormalize=True),
    "grouped_sigmoid": RoutingConfig(
        "grouped_sigmoid", 2, 8, renormalize=True, num_groups=4, topk_groups=2,
        scaling_factor=2.5,
    ),
    "sigmoid_on_input": RoutingConfig("sigmoid_on_input", 1, 8),
}  # fmt: skip
# The largest error against float64, relative to the result's largest magnitude: float32
# sums; bfloat16 (the activations and each product rounded to bfloat16); int8 activations
# (x and the hidden rows rounded to 8 bits a block).
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2, "int8": 1e-1}


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("form", ["float32", "bfloat16", "q4_0", "q8_0"])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_fused_experts_are_the_routed_experts(routing: str, form: str, tokens: int) -> None:
    hidden, n = 64, 96  # (several panels; multiples of the blocks' 32)
    experts = Experts(form, 8, hidden, n)
    config = ROUTINGS[routing]
    x = torch.randn(tokens, hidden)
    chosen = routing_of(torch.randn(tokens, config.num_experts), config)
    cases = [(False, "float32")] + ([(True, "int8")] if form.startswith("q") else [])
    if form == "bfloat16":
        x = x.bfloat16()
        cases = [(False, "bfloat16")]
    for int8_activations, precision in cases:
        got = experts.run(x, chosen, int8_activations).double()
        want = routed_experts_reference(x.float(), experts.gate_up, experts.down, chosen)
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() <= TOLERANCE[precision] * scale
        if x.dtype == torch.float32:
            assert torch.equal(got.float(), expert_by_expert(experts, x, chosen, int8_activations))


def expert_by_expert(
    experts: Experts, x: torch.Tensor, routing: Routing, int8_activations: bool
) -> torch.Tensor:
    """The same product from the panel kernels, an expert at a time, each expert's
    weighted rows added in ascending expert order: the bits fused_experts must give."""
    out = torch.zeros_like(x)
    hidden_size = x.shape[1]
    for e in torch.unique(routing.expert_ids).tolist():
        rows, slots = torch.where(routing.expert_ids == e)
        weight = routing.weights[rows, slots].float()[:, None]
        inputs = x[rows] * weight if routing.on_input else x[rows]
        hidden = torch.empty(len(rows), experts.n)
        gate_up = experts.packed_gate_up[e]
        ops.dense_silu_and_mul(hidden, inputs, gate_up, experts.n, int8_activations)
        y = torch.empty(len(rows), hidden_size)
        ops.dense(y, hidden, experts.packed_down[e], None, hidden_size, int8_activations)
        for i, row in enumerate(rows.tolist()):  # (one at a time: a row may come twice)
            out[row] += y[i] if routing.on_input else y[i] * weight[i]
    return out


def test_a_token_routed_to_one_expert_twice_and_experts_with_none() -> None:
    experts = Experts("float32", 6, 32, 48)
    x = torch.randn(3, 32)
    ids = torch.tensor([[4, 4], [1, 4], [1, 1]])  # experts 0, 2, 3 and 5 get no token
    chosen = Routing(ids, torch.rand(3, 2))
    want = routed_experts_reference(x, experts.gate_up, experts.down, chosen)
    assert (experts.run(x, chosen).double() - want).abs().max().item() < 1e-5


def test_the_experts_sums_are_added_in_expert_order() -> None:
    """A row's sum does not depend on the order of its slots: the experts are added in
    ascending order, as transformers' loop over its experts adds them."""
    experts = Experts("float32", 8, 64, 48)
    x = torch.randn(4, 64)
    ids = torch.stack([torch.randperm(8)[:3] for _ in range(4)])  # (distinct, as top-k's)
    weights = torch.rand(4, 3)
    order = torch.tensor([2, 0, 1])
    first = experts.run(x, Routing(ids, weights))
    second = experts.run(x, Routing(ids[:, order], weights[:, order]))
    assert torch.equal(first, second)


def test_a_ranks_share_of_the_experts_adds_only_theirs() -> None:
    """Expert parallelism: each rank's stacks hold experts [first, first + count) of the
    layer's; the ranks' sums add up to the whole layer's."""
    experts = Experts("float32", 6, 32, 48)
    x = torch.randn(5, 32)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(5)]).to(torch.int32)
    ids[0] = torch.tensor([4, 5])  # (a row with no expert on the first rank)
    weights = torch.rand(5, 2)
    whole = experts.run(x, Routing(ids.long(), weights))
    parts = []
    for first in (0, 3):
        out = torch.empty_like(x)
        ops.fused_experts(
            out, x, ids, weights, experts.packed_gate_up[first : first + 3],
            experts.packed_down[first : first + 3], 48, first_expert=first, num_experts=6,
        )  # fmt: skip
        parts.append(out)
    assert torch.equal(parts[0][0], torch.zeros(32))
    assert torch.allclose(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"experts \[4, 7\) .* must lie in the layer's \[0, 6\)"):
        ops.fused_experts(
            out, x, ids, weights, experts.packed_gate_up[:3], experts.packed_down[:3], 48,
            first_expert=4, num_experts=6,
        )  # fmt: skip


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_topk_is_the_softmax_routing(renormalize: bool, dtype: torch.dtype) -> None:
    config = RoutingConfig("softmax", 4, 60, renormalize=renormalize)
    # (distinct in bfloat16 too: which of equal logits torch's topk takes is its own)
    logits = torch.stack([torch.randperm(60) / 8 - 4 for _ in range(30)]).to(dtype)
    want = route(logits, config)
    ids, weights = torch.empty(30, 4, dtype=torch.int32), torch.empty(30, 4)
    ops.moe_softmax_topk(ids, weights, logits, renormalize)
    assert torch.equal(ids.long(), want.expert_ids)
    assert torch.allclose(weights, want.weights, rtol=1e-6, atol=1e-7)


def test_softmax_topk_takes_the_lower_id_of_equal_logits() -> None:
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, 2.0]])
    ids, weights = torch.empty(1, 2, dtype=torch.int32), torch.empty(1, 2)
    ops.moe_softmax_topk(ids, weights, logits, True)
    assert ids.tolist() == [[1, 3]] and weights.tolist() == [[0.5, 0.5]]


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_topk_is_the_grouped_sigmoid_routing(
    renormalize: bool, biased: bool, dtype: torch.dtype
) -> None:
    """DeepSeek-V3's: 64 experts in 8 groups, the best 3 groups' top 6, scaled by 2.5."""
    config = RoutingConfig("grouped_sigmoid", 6, 64, renormalize=renormalize, num_groups=8,
                           topk_groups=3, scaling_factor=2.5)  # fmt: skip
    # (distinct logits, and biases that keep the sums of any two distinct too)
    logits = torch.stack([torch.randperm(64) / 16 - 2 for _ in range(30)]).to(dtype)
    bias = torch.randperm(64) / 1024 if biased else None
    want = route(logits, config, bias)
    ids, weights = torch.empty(30, 6, dtype=torch.int32), torch.empty(30, 6)
    ops.moe_grouped_topk(ids, weights, logits, bias, 8, 3, renormalize, 2.5)
    assert torch.equal(ids.long(), want.expert_ids)
    assert torch.allclose(weights, want.weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_topk_is_llama4s_routing(dtype: torch.dtype) -> None:
    config = RoutingConfig("sigmoid_on_input", 2, 16)
    logits = torch.stack([torch.randperm(16) / 4 - 2 for _ in range(9)]).to(dtype)
    want = route(logits, config)
    ids, weights = torch.empty(9, 2, dtype=torch.int32), torch.empty(9, 2)
    ops.moe_sigmoid_topk(ids, weights, logits)
    assert torch.equal(ids.long(), want.expert_ids) and want.on_input
    assert torch.allclose(weights, want.weights, rtol=1e-6, atol=1e-7)


def test_the_routing_kernels_refuse_what_they_cannot_route() -> None:
    ids, weights, logits = (
        torch.empty(2, 4, dtype=torch.int32),
        torch.empty(2, 4),
        torch.randn(2, 8),
    )
    with pytest.raises(ValueError, match="8 experts in 3 groups"):
        ops.moe_grouped_topk(ids, weights, logits, None, 3, 1, True, 1.0)
    with pytest.raises(ValueError, match="2 of them, cannot hold top_k 4"):
        ops.moe_grouped_topk(ids, weights, logits, None, 8, 2, True, 1.0)
    with pytest.raises(ValueError, match=r"bias must be dense float32 \[8\]"):
        ops.moe_grouped_topk(ids, weights, logits, torch.zeros(7), 2, 1, True, 1.0)
    with pytest.raises(ValueError, match="logits must be float32"):
        ops.moe_sigmoid_topk(ids, weights, logits.half())


def test_bad_arguments_are_clear_errors() -> None:
    experts = Experts("float32", 4, 32, 48)
    x, out = torch.randn(2, 32), torch.empty(2, 32)
    ids, weights = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.rand(2, 2)
    gate_up, down = experts.packed_gate_up, experts.packed_down

    def call(**changes: object) -> None:
        args = {"out": out, "x": x, "ids": ids, "weights": weights, "gate_up": gate_up,
                "down": down, "n": 48} | changes  # fmt: skip
        ops.fused_experts(**args)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match=r"ids\[1, 1\] is 4, outside \[0, 4\)"):
        call(ids=torch.tensor([[0, 1], [2, 4]], dtype=torch.int32))
    with pytest.raises(ValueError, match="ids must be int32"):
        call(ids=ids.long())
    with pytest.raises(ValueError, match=r"weights must be \[2, 2\]"):
        call(weights=torch.rand(2, 3))
    with pytest.raises(ValueError, match=r"down must be \[4, size\]"):
        call(down=down[:3])
    with pytest.raises(ValueError, match="packed must be a packed"):
        call(n=40)
    with pytest.raises(ValueError, match="out must not be x"):
        call(out=x)
    shared = {"shared_gate_up": gate_up[0], "shared_down": down[0], "shared_n": 48}
    call(**shared, shared_gate=torch.randn(32))  # (as it should be)
    with pytest.raises(ValueError, match="shared_n must be positive"):
        call(**shared | {"shared_n": 0})
    with pytest.raises(ValueError, match="shared_down is missing"):
        call(**shared | {"shared_down": None})
    with pytest.raises(ValueError, match=r"shared_gate must be dense float32 \[32\]"):
        call(**shared, shared_gate=torch.randn(31))
    with pytest.raises(ValueError, match="top_k .* must be in"):
        ops.moe_softmax_topk(
            torch.empty(2, 5, dtype=torch.int32), torch.empty(2, 5), torch.randn(2, 4), False
        )
