"""The tensor-parallel layers, shard by shard: for each world size, every rank's layer is
built and loaded from the same checkpoint tensors in one process, and the ranks' partial
results, joined as the collectives would join them (concatenated or summed), equal the
unsharded layer's against float64; the linear-method choice and the adapter hook."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pyengine.distributed import TensorParallelGroup
from pyengine.layers.block_quantized import BLOCK, BlockQuantized
from pyengine.layers.linear import (
    ColumnParallelLinear,
    LayerContext,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    linear_from_weight,
    process_weights_after_loading,
)
from pyengine.layers.placement import Placement
from pyengine.layers.quantization import LinearMethods
from pyengine.layers.quantization.gguf import GGUFBlockMethod
from pyengine.layers.quantization.unquantized import (
    BF16PanelsMethod,
    PackedPanelsMethod,
    SplitBF16Method,
    TorchLinearMethod,
    split_gemm_enabled,
)
from pyengine.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

TORCH = Placement(dtype=torch.float64)  # torch's matmul, in float64: exact comparisons


def rand(*shape: int) -> torch.Tensor:
    """Float32 values (layers stage weights in float32) held in float64."""
    return torch.randn(*shape).double()


def contexts(world_size: int, placement: Placement = TORCH) -> list[LayerContext]:
    return [
        LayerContext(placement, TensorParallelGroup(world_size, rank)) for rank in range(world_size)
    ]


def prepared(layer: torch.nn.Module, placement: Placement = TORCH) -> torch.nn.Module:
    process_weights_after_loading(layer, placement)
    return layer


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_column_parallel_shards_concatenate_to_the_whole(world_size: int) -> None:
    w, b = rand(24, 16), rand(24)
    x = rand(5, 16)
    parts = []
    for ctx in contexts(world_size):
        layer = ColumnParallelLinear(16, [24], True, ctx, ["w"])
        with torch.no_grad():
            layer.weight_loader("w", "weight", w)
            layer.weight_loader("b", "bias", b)
        parts.append(prepared(layer)(x))
    torch.testing.assert_close(torch.cat(parts, dim=1), x @ w.T + b)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_row_parallel_partial_products_sum_to_the_whole(world_size: int) -> None:
    w, b = rand(12, 32), rand(12)
    x = rand(5, 32)
    total = torch.zeros(5, 12, dtype=torch.float64)
    for ctx in contexts(world_size):
        layer = RowParallelLinear(32, 12, False, ctx, ["w"])
        with torch.no_grad():
            layer.weight_loader("w", "weight", w)
        start, length = layer.input_start, layer.input_size_per_partition
        # Its slice of x, as a column-parallel layer leaves it; the sum is the all-reduce's.
        total += prepared(layer).method.apply(layer, x[:, start : start + length], None)
    torch.testing.assert_close(total + b, x @ w.T + b)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_merged_gate_up_shards_hold_their_gate_and_up_rows(world_size: int) -> None:
    gate, up = rand(8, 16).float(), rand(8, 16).float()
    x = rand(3, 16).float()
    parts = []
    for ctx in contexts(world_size, Placement()):  # packed: one fused op a shard
        layer = MergedColumnParallelLinear(16, [8, 8], False, ctx, ["g", "u"], gate_up=True)
        with torch.no_grad():
            layer.weight_loader("g", "weight", gate, 0)
            layer.weight_loader("u", "weight", up, 1)
        parts.append(prepared(layer, Placement()).silu_and_mul(x))
    xd = x.double()
    expected = torch.nn.functional.silu(xd @ gate.double().T) * (xd @ up.double().T)
    torch.testing.assert_close(torch.cat(parts, dim=1).double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("world_size", "num_kv_heads"), [(1, 2), (2, 2), (4, 2), (4, 1)])
def test_qkv_shards_split_heads_and_replicate_kv_heads(world_size: int, num_kv_heads: int) -> None:
    head, heads, hidden = 4, 4, 16
    q = rand(heads * head, hidden)
    k = rand(num_kv_heads * head, hidden)
    v = rand(num_kv_heads * head, hidden)
    x = rand(3, hidden)
    qs, ks, vs = [], [], []
    for ctx in contexts(world_size):
        layer = QKVParallelLinear(hidden, head, heads, num_kv_heads, False, ctx, ["q", "k", "v"])
        with torch.no_grad():
            layer.load_fused("qkv", "weight", torch.cat([q, k, v]))
        out = prepared(layer)(x)
        q_size, kv_size, _ = layer.local_sizes
        assert q_size == heads // world_size * head
        assert kv_size == max(1, num_kv_heads // world_size) * head
        a, b, c = out.split([q_size, kv_size, kv_size], dim=1)
        qs.append(a)
        ks.append(b)
        vs.append(c)
    torch.testing.assert_close(torch.cat(qs, dim=1), x @ q.T)
    # Each kv head once, in order: ranks that share one hold the same values.
    per_head = max(1, world_size // num_kv_heads)
    torch.testing.assert_close(torch.cat(ks[::per_head], dim=1), x @ k.T)
    torch.testing.assert_close(torch.cat(vs[::per_head], dim=1), x @ v.T)


def test_shards_that_would_not_be_equal_are_refused() -> None:
    ctx = contexts(3)[0]
    with pytest.raises(ValueError, match=r"output size of part 0 \(8\) is not divisible"):
        ColumnParallelLinear(4, [8], False, ctx, ["w"])
    with pytest.raises(ValueError, match=r"num_heads \(4\) is not divisible"):
        QKVParallelLinear(16, 4, 4, 4, False, ctx, ["q", "k", "v"])
    with pytest.raises(ValueError, match="rank must be in"):
        TensorParallelGroup(2, 2)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_vocab_parallel_embedding_and_head_join_to_the_whole(world_size: int) -> None:
    vocab, hidden = 10, 8  # 10 rows do not split evenly over 3: the last rank pads
    table = rand(vocab, hidden)
    ids = torch.tensor([0, 9, 3, 5, 5])
    h = rand(4, hidden)
    embedded = torch.zeros(len(ids), hidden, dtype=torch.float64)
    logits = []
    for ctx in contexts(world_size):
        embedding = VocabParallelEmbedding(vocab, hidden, ctx)
        head = ParallelLMHead(vocab, hidden, ctx, ["e"], tied_to=embedding)
        with torch.no_grad():
            embedding.weight_loader("e", table)
        module = torch.nn.Module()
        module.embedding, module.head = embedding, head
        prepared(module)
        # The sum over ranks, as the group's all_reduce: each rank adds the rows it holds.
        local = ids - embedding.start
        held = (local >= 0) & (local < embedding.rows)
        part = torch.nn.functional.embedding(local.clamp(0, embedding.rows - 1), embedding.weight)
        embedded += part * held[:, None]
        logits.append(torch.nn.functional.linear(h, head.weight))
        assert head.weight.data_ptr() == embedding.weight.data_ptr()  # tied: shared
    torch.testing.assert_close(embedded, table[ids])
    torch.testing.assert_close(torch.cat(logits, dim=1)[:, :vocab], h @ table.T)


def test_shape_mismatches_name_the_weight() -> None:
    layer = ColumnParallelLinear(16, [8], False, LayerContext(TORCH), ["w"])
    with pytest.raises(ValueError, match=r"weight w: shape \(8, 15\), model expects \(8, 16\)"):
        layer.weight_loader("w", "weight", torch.zeros(8, 15))


def test_methods_are_chosen_from_the_placement_and_the_checkpoint() -> None:
    cpu = LinearMethods(Placement(), frozenset({"a", "b"}))
    assert isinstance(cpu.choose(["a", "b"]), GGUFBlockMethod)  # every part has blocks
    # one part lacks them: float32 panels, with a split-bfloat16 form on AMX CPUs
    panels = SplitBF16Method if split_gemm_enabled() else PackedPanelsMethod
    assert type(cpu.choose(["a", "c"])) is panels
    assert type(cpu.choose(["a", "c"], many_rows=False)) is PackedPanelsMethod
    # bfloat16 on the CPU: its own panels (GGUF blocks dequantized at load); float16:
    # torch's matmul, as on CUDA
    bf16 = LinearMethods(Placement(dtype=torch.bfloat16), frozenset({"a"}))
    assert isinstance(bf16.choose(["a"]), BF16PanelsMethod)
    half = LinearMethods(Placement(dtype=torch.float16), frozenset({"a"}))
    assert isinstance(half.choose(["a"]), TorchLinearMethod)


def test_block_shards_take_rows_and_whole_blocks_of_columns() -> None:
    rng = np.random.default_rng(0)
    blocks = BlockQuantized(
        rng.integers(0, 16, (6, 2 * BLOCK)).astype(np.uint8),
        rng.random((6, 2)).astype(np.float32),
        rng.random((6, 2)).astype(np.float32),
    )
    whole = blocks.dequantize()
    np.testing.assert_array_equal(blocks.rows(2, 5).dequantize(), whole[2:5])
    np.testing.assert_array_equal(blocks.columns(BLOCK, 2 * BLOCK).dequantize(), whole[:, BLOCK:])
    with pytest.raises(ValueError, match="split its blocks"):
        blocks.columns(0, BLOCK // 2)


class LowRankDelta:
    """x @ A.T @ B.T added to a layer's product, as a LoRA adapter adds its delta."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b

    def add_delta(self, layer: object, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out + x @ self.a.T @ self.b.T


@pytest.mark.parametrize(
    "placement",
    [Placement(), Placement(dtype=torch.bfloat16), Placement(dtype=torch.float16)],
    ids=["packed", "bf16_panels", "torch"],
)
def test_adapter_hook_adds_its_delta(placement: Placement) -> None:
    dtype = placement.dtype
    # Small integers: every product and sum exact in 16 bits too; only silu rounds.
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2

    def ints(*shape: int, bound: int = 2) -> torch.Tensor:
        return torch.randint(-bound, bound + 1, shape).to(dtype)

    w, gate_up = ints(12, 16), ints(2 * 6, 16)
    a, b = ints(2, 16, bound=1), ints(12, 2, bound=1)
    x = ints(3, 16)
    ctx = LayerContext(placement)
    layer, gated = linear_from_weight(w, ctx), linear_from_weight(gate_up, ctx, gate_up=True)
    layer.adapter = gated.adapter = LowRankDelta(a, b)
    wide = (x.double() @ a.double().T) @ b.double().T
    torch.testing.assert_close(
        layer(x).double(), x.double() @ w.double().T + wide, rtol=tolerance, atol=tolerance
    )
    if isinstance(gated.method, PackedPanelsMethod):  # paired for the fused op only
        with pytest.raises(ValueError, match="multiplies only fused with silu_and_mul"):
            gated.silu_and_mul(x)
        return
    product = x.double() @ gate_up.double().T + wide  # the delta joins before silu
    expected = torch.nn.functional.silu(product[:, :6]) * product[:, 6:]
    torch.testing.assert_close(
        gated.silu_and_mul(x).double(), expected, rtol=tolerance, atol=tolerance
    )


def _gloo_rank(rank: int, world_size: int, init: str, tensors: dict[str, torch.Tensor]) -> None:
    """One rank of test_layers_join_their_shards_over_a_real_group: its layers' outputs,
    through the group's collectives, must be the whole layers'."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        ctx = LayerContext(TORCH, TensorParallelGroup(world_size, rank))
        column = ColumnParallelLinear(16, [8], False, ctx, ["c"], gather_output=True)
        row = RowParallelLinear(8, 6, True, ctx, ["r"])
        embedding = VocabParallelEmbedding(9, 16, ctx)  # 9 rows: the last rank pads
        head = ParallelLMHead(9, 16, ctx, ["e"], tied_to=embedding)
        with torch.no_grad():
            column.weight_loader("c", "weight", tensors["c"])
            row.weight_loader("r", "weight", tensors["r"])
            row.weight_loader("rb", "bias", tensors["rb"])
            embedding.weight_loader("e", tensors["e"])
        model = torch.nn.Module()
        model.column, model.row, model.embedding, model.head = column, row, embedding, head
        prepared(model)
        x, ids = tensors["x"], tensors["ids"]
        hidden = column(x)  # gathered: the whole [tokens, 8]
        start, length = row.input_start, row.input_size_per_partition
        out = row(hidden[:, start : start + length])
        torch.testing.assert_close(hidden, x @ tensors["c"].T)
        torch.testing.assert_close(out, hidden @ tensors["r"].T + tensors["rb"])
        torch.testing.assert_close(embedding(ids), tensors["e"][ids])
        torch.testing.assert_close(head(x), x @ tensors["e"].T)
    finally:
        dist.destroy_process_group()


def test_layers_join_their_shards_over_a_real_group(tmp_path: Path) -> None:
    """Two processes in a gloo group: all_reduce and all_gather as a tensor-parallel
    worker runs them."""
    tensors = {
        "c": rand(8, 16), "r": rand(6, 8), "rb": rand(6), "e": rand(9, 16),
        "x": rand(3, 16), "ids": torch.tensor([0, 4, 5, 8, 8]),
    }  # fmt: skip
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_gloo_rank, args=(2, init, tensors), nprocs=2, join=True)
