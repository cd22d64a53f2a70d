"""Llama 4's text model on tiny random checkpoints that transformers makes in the test:
chunked local attention (chunks shorter than the prompts) on the rotary layers, a NoPE
layer whose queries' temperature grows within the prompts (floor_scale small), the
weightless q/k norm, interleaved rotary embeddings with llama3 scaling, and experts with
a shared one on every other layer (the sigmoid of the router's choice scaling their
input). Greedy float32 tokens and logits are transformers'."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.hf_reference import (
    assert_preemption_keeps_tokens,
    assert_ranks_give_one_ranks_tokens,
    assert_tokens_and_logits_match,
)

from pyengine import LLM

transformers = pytest.importorskip("transformers")

CHUNK = 16
ENGINE = dict(max_model_len=256, kv_cache_memory=32 * 2**20, dtype="float32")


def config() -> object:
    return transformers.Llama4TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=48, intermediate_size_mlp=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, attention_chunk_size=CHUNK, no_rope_layer_interval=4,
        floor_scale=8, attn_scale=0.5, use_qk_norm=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    )  # fmt: skip


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("llama4")
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(config()).to(torch.float32)
    with torch.no_grad():  # (random norms too; the experts start at zero in transformers)
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.08)
    model.eval().save_pretrained(folder)
    return folder, model


def test_greedy_tokens_and_logits_match_transformers(llama4) -> None:  # type: ignore[no-untyped-def]
    folder, model = llama4
    llm = LLM(str(folder), max_num_batched_tokens=32, **ENGINE)  # (chunked prefill)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert runner.kv_layout.groups == (("full", 0), ("chunked", CHUNK), ("chunked", CHUNK),
                                       ("chunked", CHUNK))  # fmt: skip
    rng = np.random.default_rng(2)
    shared = rng.integers(0, 256, 40).tolist()
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 20, 90)] + [shared, shared + [5]]
    tokens = rng.integers(0, 256, 70).tolist()  # (past a few chunks and temperature steps)
    assert_tokens_and_logits_match(llm, model, prompts, tokens)


def test_preemption_keeps_the_tokens(llama4) -> None:  # type: ignore[no-untyped-def]
    folder, model = llama4
    specs = [("chunked", CHUNK)] * 3 + [("full", 0)]
    assert_preemption_keeps_tokens(folder, model, specs, ENGINE)


@pytest.mark.slow
def test_two_ranks_give_one_ranks_tokens(llama4) -> None:  # type: ignore[no-untyped-def]
    folder, _ = llama4
    assert_ranks_give_one_ranks_tokens(folder, ENGINE, [{"tensor_parallel_size": 2}])
