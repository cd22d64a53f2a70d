"""Granite 4 (GraniteMoeHybridForCausalLM) on tiny random checkpoints that transformers
makes in the test: Mamba-2 layers (random decays, skips, steps, convolution biases,
norms; two groups of B and C) around one attention layer, with experts and a shared
expert (rope) or the shared MLP alone (no positions), and every multiplier of its own
(embeddings, residuals, the attention's scale, the logits). Greedy float32 tokens and
logits identical to transformers', through chunked prefill beside other requests'
decodes, preemption and parallel samples; over two tensor-parallel ranks or two pipeline
stages, one rank's tokens."""

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
    vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=2, max_position_embeddings=256,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
    mamba_chunk_size=8, shared_intermediate_size=48, embedding_multiplier=3.0,
    residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.5,
)  # fmt: skip
CONFIGS = {
    "moe_rope": lambda: transformers.GraniteMoeHybridConfig(
        **SHAPE,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        position_embedding_type="rope",
    ),  # fmt: skip
    "dense_nope": lambda: transformers.GraniteMoeHybridConfig(**SHAPE, num_local_experts=0),
}
ENGINE = dict(max_model_len=256, kv_cache_memory=32 * 2**20, dtype="float32")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def granite(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        CONFIGS[request.param](), dtype=torch.float32
    )
    randomize(model)
    model.eval().save_pretrained(folder)
    return folder, model


def test_greedy_tokens_and_logits_match_transformers(granite) -> None:  # type: ignore[no-untyped-def]
    folder, model = granite
    llm = LLM(str(folder), max_num_batched_tokens=7, **ENGINE)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert runner.kv_layout.groups == (("full", 0),) and len(runner.state_layers) == 3
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n).tolist() for n in (1, 3, 20, 90)]
    assert_tokens_and_logits_match(llm, model, prompts, rng.integers(0, 256, 70).tolist())


def test_prefills_by_chunks_keep_the_tokens(granite) -> None:  # type: ignore[no-untyped-def]
    folder, model = granite
    assert_chunked_form_keeps_tokens(folder, model, ENGINE)


def test_speculative_decoding_puts_the_state_back_where_a_draft_is_rejected(granite) -> None:  # type: ignore[no-untyped-def]
    folder, model = granite
    assert_speculation_keeps_tokens(folder, model, ENGINE)


def test_preemption_and_parallel_samples_keep_the_tokens(granite) -> None:  # type: ignore[no-untyped-def]
    assert_preemption_and_forks_keep_tokens(*granite, ENGINE)


@pytest.mark.slow
def test_two_ranks_give_one_ranks_tokens(granite) -> None:  # type: ignore[no-untyped-def]
    folder, _ = granite
    assert_ranks_give_one_ranks_tokens(
        folder, ENGINE, [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}]
    )
