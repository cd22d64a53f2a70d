"""CUDA graphs of decode steps: the ladder of captured sizes, and (on a GPU) the same
greedy tokens as eager steps. The GPU tests are skipped, with the reason shown, where
there is no GPU or pyengine was built without CUDA."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.replays import count_replays

from pyengine import LLM, SamplingParams, built_with_cuda
from pyengine.worker.cuda_graphs import MAX_CAPTURED_BATCH, capture_sizes

on_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and built_with_cuda()),
    reason="needs a CUDA GPU and pyengine built with CUDA",
)


def test_capture_sizes_climb_to_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and sizes == sorted(set(sizes))
    for many in (MAX_CAPTURED_BATCH, 600, 10_000):
        sizes = capture_sizes(many)
        assert sizes[-1] == MAX_CAPTURED_BATCH and sizes == sorted(set(sizes))


# A small Llama with random weights (seeded, so both engines get the same ones): no
# model files needed on the GPU machine.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def generate(folder: Path, enforce_eager: bool, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(
        str(folder),
        load_format="dummy",
        device="cuda",
        dtype="float32",
        max_model_len=2048,  # contexts past 512 keys: the graphs hold the split attention
        max_num_seqs=16,
        gpu_memory_utilization=0.2,
        enforce_eager=enforce_eager,
    )
    graphs = llm.llm_engine.executor.driver_worker.model_runner.graphs
    assert (graphs is None) == enforce_eager
    replays = count_replays(graphs) if graphs is not None else []
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    if graphs is not None:
        assert (13, 16) in replays, "no decode step of all 13 requests replayed a graph"
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens


@pytest.mark.gpu
@on_gpu
def test_graphs_and_eager_steps_give_the_same_tokens(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 4096, n).tolist() for n in (3, 17, 40, 90, 5, 700, 64, 8)]
    prompts += prompts[:5]  # 13 requests: padded to a graph of 16
    assert generate(tmp_path, True, prompts) == generate(tmp_path, False, prompts)


@pytest.mark.gpu
@on_gpu
def test_the_graphs_fit_in_gpu_memory_utilization(tmp_path: Path) -> None:
    """The KV cache leaves room for the graphs: the process stays within its fraction of
    the device memory after capture and after running, and the room left is about what
    the graphs took."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    budget = 0.2 * total
    llm = LLM(str(tmp_path), load_format="dummy", device="cuda", max_model_len=2048,
              max_num_seqs=256, gpu_memory_utilization=0.2)  # fmt: skip
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert runner.graphs is not None and runner.graphs.sizes[-1] == 256
    taken, expected = runner.graphs.device_bytes, runner.graph_bytes_expected
    # The probe's figure also holds what its capture kept (cuBLAS's 32 MiB workspace).
    assert taken > 0 and 0.8 * taken <= expected <= 2 * taken + (64 << 20), (taken, expected)
    tolerance = 0.03 * budget
    assert total - torch.cuda.mem_get_info()[0] <= budget + tolerance
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 4096, n).tolist() for n in rng.integers(1, 300, 200)]
    llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert total - torch.cuda.mem_get_info()[0] <= budget + tolerance
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
