"""Granite 4 (GraniteMoeHybridForCausalLM) on tiny random checkpoints that transformers
makes in the test: Mamba-2 layers (random decays, skips, steps, convolution biases,
norms; two groups of B and C) around one attention layer, with experts and a shared
expert (rope) or the shared MLP alone (no positions), and every multiplier of its own
(embeddings, residuals, the attention's scale, the logits). Greedy float32 tokens and
logits identical to transformers', through chunked prefill beside other requests'
decodes, preemption and parallel samples; over two ranks, one rank's tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.hf_reference import (
    assert_ranks_give_one_ranks_tokens,
    assert_tokens_and_logits_match,
    hf_greedy,
)

from pyengine import LLM, SamplingParams
from pyengine.worker.state_pool import slot_bytes

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
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", "D")):
                p.normal_(0.0, 1.0)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
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


def test_preemption_and_parallel_samples_keep_the_tokens(granite) -> None:  # type: ignore[no-untyped-def]
    """A KV pool of one block more than a request of max_model_len may hold: requests
    are preempted (their states computed again); n = 2 forks a state."""
    folder, model = granite
    probe = LLM(str(folder), **ENGINE)
    runner = probe.llm_engine.executor.driver_worker.model_runner
    block, state = runner.block_bytes, slot_bytes(runner.state_layers)
    probe.llm_engine.shutdown()
    blocks = runner.kv_layout.max_blocks_held(128, 32, 16) + 1
    options = {"kv_cache_memory": blocks * block + 2 * state, "max_model_len": 128,
               "max_num_batched_tokens": 32, "max_num_seqs": 2}  # fmt: skip
    llm = LLM(str(folder), **{**ENGINE, **options})
    assert llm.llm_engine.executor.driver_worker.model_runner.num_state_slots == 2
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, n).tolist() for n in (50, 60, 70)]  # (any two: 11 blocks)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 20)
    assert llm.llm_engine.scheduler.stats().num_preemptions > 0
    two = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2)
    (pair,) = llm.generate([{"prompt_token_ids": prompts[0]}], two, use_tqdm=False)
    want = hf_greedy(model, prompts[0], 10)
    assert [c.token_ids for c in pair.outputs] == [want, want]


@pytest.mark.slow
def test_two_ranks_give_one_ranks_tokens(granite) -> None:  # type: ignore[no-untyped-def]
    folder, _ = granite
    assert_ranks_give_one_ranks_tokens(folder, ENGINE, [{"tensor_parallel_size": 2}])
