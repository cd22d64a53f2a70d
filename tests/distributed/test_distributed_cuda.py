"""The `mp` executor on CUDA: one rank in its own process on one GPU gives the tokens of
the in-process engine; NCCL tensor parallelism over two GPUs where the machine has them.
Skipped, with the reason shown, without a GPU or a CUDA build (bench/gpu/run.sh runs it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import TINY_LLAMA

from pyengine import LLM, SamplingParams, built_with_cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and built_with_cuda()),
        reason="needs a CUDA GPU and pyengine built with CUDA",
    ),
]

ENGINE = dict(load_format="dummy", max_model_len=256, dtype="float32", device="cuda",
              gpu_memory_utilization=0.3)  # fmt: skip
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(20, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder: Path = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(folder)


def tokens(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def run(model: str, **engine_args: object) -> list[list[int]]:
    llm = LLM(model, **ENGINE, **engine_args)
    try:
        return tokens(llm)
    finally:
        llm.engine.shutdown()


def test_one_rank_in_its_own_process_gives_the_in_process_tokens(model: str) -> None:
    assert run(model, distributed_executor_backend="mp") == run(model)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL tensor parallelism needs 2 GPUs")
def test_nccl_tensor_parallelism_gives_one_rank_tokens(model: str) -> None:
    assert run(model, tensor_parallel_size=2) == run(model)
