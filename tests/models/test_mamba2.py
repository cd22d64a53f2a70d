"""Mamba-2 on tiny random checkpoints that transformers makes in the test: state-space
layers alone (random decays, skips, steps, convolution biases and norms; two groups of
B and C; transformers' own scan in chunks of 8). Greedy float32 tokens and logits
identical to transformers', through chunked prefill (chunks of 7 tokens beside other
requests' decodes), requests waiting for a state slot, and parallel samples; over two
tensor-parallel ranks or two pipeline stages, one rank's tokens; blocks that hold
nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.hf_reference import (
    assert_ranks_give_one_ranks_tokens,
    assert_tokens_and_logits_match,
)
from helpers.hybrid import (
    assert_chunked_form_keeps_tokens,
    assert_generations_and_forks,
    assert_speculation_keeps_tokens,
    randomize,
)

from pyengine import LLM

transformers = pytest.importorskip("transformers")

ENGINE = dict(max_model_len=256, kv_cache_memory=32 * 2**20, dtype="float32")


@pytest.fixture(scope="module")
def mamba(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("mamba2")
    torch.manual_seed(0)
    config = transformers.Mamba2Config(
        vocab_size=256, hidden_size=64, num_hidden_layers=3, num_heads=8, head_dim=16,
        expand=2, n_groups=2, state_size=16, conv_kernel=4, chunk_size=8,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    model.eval().save_pretrained(folder)
    return folder, model


def test_greedy_tokens_and_logits_match_transformers(mamba) -> None:  # type: ignore[no-untyped-def]
    folder, model = mamba
    llm = LLM(str(folder), max_num_batched_tokens=7, **ENGINE)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert runner.kv_slots == [] and runner.block_bytes == 0  # (blocks that hold nothing)
    assert len(runner.state_layers) == 3
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n).tolist() for n in (1, 3, 20, 90)]
    assert_tokens_and_logits_match(llm, model, prompts, rng.integers(0, 256, 70).tolist())


def test_prefills_by_chunks_keep_the_tokens(mamba) -> None:  # type: ignore[no-untyped-def]
    folder, model = mamba
    assert_chunked_form_keeps_tokens(folder, model, ENGINE)


def test_speculative_decoding_puts_the_state_back_where_a_draft_is_rejected(mamba) -> None:  # type: ignore[no-untyped-def]
    folder, model = mamba
    assert_speculation_keeps_tokens(folder, model, ENGINE)


def test_preemption_and_parallel_samples_keep_the_tokens(mamba) -> None:  # type: ignore[no-untyped-def]
    """Two state slots for three requests: the third waits for a slot, which comes to it
    zeroed (has_state 0); n = 2 forks a state, and both samples go on from it."""
    folder, model = mamba
    options = {"max_num_seqs": 2, "max_model_len": 128, "max_num_batched_tokens": 32,
               "enable_prefix_caching": False}  # fmt: skip
    llm = LLM(str(folder), **{**ENGINE, **options})
    assert_generations_and_forks(llm, model)


@pytest.mark.slow
def test_two_ranks_give_one_ranks_tokens(mamba) -> None:  # type: ignore[no-untyped-def]
    folder, _ = mamba
    assert_ranks_give_one_ranks_tokens(
        folder, ENGINE, [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}]
    )
