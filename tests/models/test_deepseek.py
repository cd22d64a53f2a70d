"""DeepSeek-V2 and V3 on tiny random checkpoints that transformers makes in the test:
multi-head latent attention (V2 with q_proj whole, V3 through q_lora_rank; YaRN with
mscale_all_dim on V3) over a latent KV cache, a dense first layer, then experts with a
shared one (V2: softmax limited to the top groups; V3: sigmoid scores a random
correction bias steers), routed_scaling_factor not 1. Greedy float32 tokens and logits
are transformers', with chunked prefill, a shared prefix, preemption and at TP=2."""

from __future__ import annotations

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

SHAPE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8,
    num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
    topk_group=2, routed_scaling_factor=1.5, max_position_embeddings=256,
    tie_word_embeddings=False,
)  # fmt: skip
CONFIGS = {
    "v2": lambda: transformers.DeepseekV2Config(
        **SHAPE, q_lora_rank=None, topk_method="group_limited_greedy", norm_topk_prob=False
    ),
    "v3": lambda: transformers.DeepseekV3Config(
        **SHAPE, q_lora_rank=48, norm_topk_prob=True, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8,
            "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
            "rope_theta": 10000.0,
        },
    ),
}  # fmt: skip
ENGINE = dict(max_model_len=256, kv_cache_memory=32 * 2**20, dtype="float32")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def deepseek(request, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp(f"deepseek-{request.param}")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        CONFIGS[request.param](), dtype=torch.float32
    )
    with torch.no_grad():  # (random norms, router and correction bias too)
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.08)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.3)
    model.eval().save_pretrained(folder)
    return request.param, folder, model


def test_greedy_tokens_and_logits_match_transformers(deepseek) -> None:  # type: ignore[no-untyped-def]
    _, folder, model = deepseek
    llm = LLM(str(folder), max_num_batched_tokens=32, **ENGINE)  # (chunked prefill)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    # (one latent vector of kv_lora_rank + qk_rope_head_dim a token and layer)
    assert runner.caches[0][0].shape[1:] == (16, 48) and runner.kv_halves == 1
    rng = np.random.default_rng(2)
    shared = rng.integers(0, 256, 40).tolist()
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 20, 90)] + [shared, shared + [5]]
    assert_tokens_and_logits_match(llm, model, prompts, rng.integers(0, 256, 100).tolist())
    assert llm.llm_engine.scheduler.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
def test_preemption_keeps_the_tokens(deepseek, swap: bool) -> None:  # type: ignore[no-untyped-def]
    """Preempted requests computed again, or swapped out to the host tier and back (its
    blocks a latent vector a token and layer, one half, not K and V)."""
    _, folder, model = deepseek
    engine = {**ENGINE, "kv_offload_gb": 0.01, "preemption_mode": "swap"} if swap else ENGINE
    llm = assert_preemption_keeps_tokens(folder, model, [("full", 0)] * 3, engine, latent=48)
    assert (llm.llm_engine.scheduler.stats().num_swapped_preemptions > 0) == swap


@pytest.mark.slow
def test_two_ranks_give_one_ranks_tokens(deepseek) -> None:  # type: ignore[no-untyped-def]
    _, folder, _ = deepseek
    assert_ranks_give_one_ranks_tokens(folder, ENGINE, [{"tensor_parallel_size": 2}])
