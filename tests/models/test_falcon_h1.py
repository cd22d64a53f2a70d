"""Falcon-H1 on tiny random checkpoints that transformers makes in the test: every layer
attention and a Mamba-2 mixer side by side (random decays, skips, steps, convolution
biases, norms; two groups of B and C; an inner size of its own), and every multiplier of
its own (attention in and out, keys, the mixer's input, its five sections and its
output, the MLP's gate and down, the embeddings, the logits), with the mixer's norm
before the gate, after it, or none. Greedy float32 tokens and logits identical to
transformers', through chunked prefill beside other requests' decodes, preemption and
parallel samples; over two tensor-parallel ranks or two pipeline stages, one rank's
tokens."""

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
    assert_preemption_and_forks_keep_tokens,
    assert_speculation_keeps_tokens,
    randomize,
)

from pyengine import LLM

transformers = pytest.importorskip("transformers")

SHAPE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
    mamba_d_ssm=96, mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
    mamba_chunk_size=8, attention_in_multiplier=0.7, attention_out_multiplier=1.3,
    key_multiplier=0.6, ssm_in_multiplier=1.2, ssm_out_multiplier=0.8,
    ssm_multipliers=[0.9, 1.1, 0.5, 1.5, 0.7], mlp_multipliers=[0.8, 1.25],
    embedding_multiplier=2.0, lm_head_multiplier=0.5,
)  # fmt: skip
CONFIGS = {
    "norm_before_gate": dict(mamba_rms_norm=True, mamba_norm_before_gate=True),
    "norm_after_gate": dict(mamba_rms_norm=True, mamba_norm_before_gate=False),
    "no_norm": dict(mamba_rms_norm=False),
}
ENGINE = dict(max_model_len=256, kv_cache_memory=32 * 2**20, dtype="float32")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def falcon(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    config = transformers.FalconH1Config(**SHAPE, **CONFIGS[request.param])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    model.eval().save_pretrained(folder)
    return folder, model


def test_greedy_tokens_and_logits_match_transformers(falcon) -> None:  # type: ignore[no-untyped-def]
    folder, model = falcon
    llm = LLM(str(folder), max_num_batched_tokens=7, **ENGINE)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert runner.kv_slots == [0, 1, 2] and len(runner.state_layers) == 3  # (both a layer)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n).tolist() for n in (1, 3, 20, 90)]
    assert_tokens_and_logits_match(llm, model, prompts, rng.integers(0, 256, 70).tolist())


def test_prefills_by_chunks_keep_the_tokens(falcon) -> None:  # type: ignore[no-untyped-def]
    folder, model = falcon
    assert_chunked_form_keeps_tokens(folder, model, ENGINE)


def test_speculative_decoding_puts_the_state_back_where_a_draft_is_rejected(falcon) -> None:  # type: ignore[no-untyped-def]
    folder, model = falcon
    assert_speculation_keeps_tokens(folder, model, ENGINE)


def test_preemption_and_parallel_samples_keep_the_tokens(falcon) -> None:  # type: ignore[no-untyped-def]
    assert_preemption_and_forks_keep_tokens(*falcon, ENGINE)


@pytest.mark.slow
def test_two_ranks_give_one_ranks_tokens(falcon) -> None:  # type: ignore[no-untyped-def]
    folder, _ = falcon
    assert_ranks_give_one_ranks_tokens(
        folder, ENGINE, [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}]
    )
