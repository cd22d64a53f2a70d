"""The `mp` executor on CUDA: one rank in its own process on one GPU gives the tokens of
the in-process engine; NCCL tensor parallelism over two GPUs where the machine has them.
Skipped, with the reason shown, without a GPU or a CUDA build (bench/gpu/run.sh runs it)."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import greedy_tokens

from pyengine import LLM, built_with_cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and built_with_cuda()),
        reason="needs a CUDA GPU and pyengine built with CUDA",
    ),
]

ENGINE = dict(load_format="dummy", max_model_len=256, dtype="float32", device="cuda",
              gpu_memory_utilization=0.3)  # fmt: skip


def run(model: str, **engine_args: object) -> list[list[int]]:
    llm = LLM(model, **ENGINE, **engine_args)
    try:
        return greedy_tokens(llm)
    finally:
        llm.llm_engine.shutdown()


def test_one_rank_in_its_own_process_gives_the_in_process_tokens(model: str) -> None:
    assert run(model, distributed_executor_backend="mp") == run(model)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL tensor parallelism needs 2 GPUs")
def test_nccl_tensor_parallelism_gives_one_rank_tokens(model: str) -> None:
    assert run(model, tensor_parallel_size=2) == run(model)
