"""Each tensor-parallel rank reads only its shard of each safetensors weight (regions of
the file, never the whole tensor), and the shards it loads are the whole tensor's rows
or columns; LazySlice records narrowing and transposition until it reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pyengine.distributed import TensorParallelGroup
from pyengine.layers.linear import LayerContext
from pyengine.loader import resolve
from pyengine.loader.resolve import load_safetensors
from pyengine.models.llama import LlamaForCausalLM
from pyengine.utils.lazy_weights import LazySlice, materialize


def test_a_lazy_slice_reads_only_the_region_left() -> None:
    whole = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    regions: list[tuple[slice, ...]] = []

    def read(region: tuple[slice, ...]) -> torch.Tensor:
        regions.append(region)
        return whole[region].clone()

    lazy = LazySlice(read, (6, 8))
    part = lazy.narrow(0, 2, 3).narrow(1, 4, 4)
    assert part.shape == (3, 4) and not regions
    assert torch.equal(materialize(part), whole[2:5, 4:8])
    assert regions == [(slice(2, 5), slice(4, 8))]
    transposed = lazy.t().narrow(0, 1, 2)  # columns 1-2 of the stored tensor
    assert transposed.shape == (2, 6)
    assert torch.equal(transposed.read(), whole.t()[1:3])
    with pytest.raises(IndexError, match="outside shape"):
        lazy.narrow(1, 6, 3)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_reads_its_shard_of_each_weight(
    tmp_path: Path, rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    from helpers.tiny_models import make_checkpoint

    reference = make_checkpoint("llama", tmp_path)
    full = dict(reference.state_dict())
    read_bytes: dict[str, int] = {}
    read_region = resolve._read_safetensor_region

    def spy(path: Path, key: str, region: tuple[slice, ...]) -> torch.Tensor:
        tensor = read_region(path, key, region)
        read_bytes[key] = read_bytes.get(key, 0) + tensor.numel() * tensor.element_size()
        return tensor

    monkeypatch.setattr(resolve, "_read_safetensor_region", spy)
    monkeypatch.setattr(resolve, "_read_safetensor", lambda *a: pytest.fail("read whole"))
    c = resolve.load_model(str(tmp_path), load_format="dummy").config
    ctx = LayerContext(tp=TensorParallelGroup(2, rank))
    model = LlamaForCausalLM(c, 64, ctx)
    model.load_weights(load_safetensors(tmp_path))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.embed_tokens.weight", "lm_head.weight"):  # fmt: skip
        whole = full[name].numel() * 4
        assert read_bytes[name] == whole // 2, name  # half of each split weight
    assert read_bytes["model.norm.weight"] == full["model.norm.weight"].numel() * 4
    # The shard this rank holds is its rows of q (heads 2r, 2r + 1 of 4).
    q = model.layers[0].self_attn.qkv_proj  # type: ignore[union-attr]
    assert q.shard_offsets[0] == (rank * 64, 64)
