"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (text) on tiny random checkpoints that
transformers makes in the test: Gated DeltaNet layers (random decays, biases of the
step, norms) around gated full attention with rope on a quarter of each head, norms
that scale by 1 + w, experts with a gated shared expert (and a dense layer among them).
Greedy float32 tokens and logits identical to transformers', through chunked prefill
(chunks of 7 tokens, mixed with other requests' decodes), preemption (the state
recomputed, or kept through a swap), parallel samples (the state copied at the fork),
prefix hits that resume the state from a checkpoint, and a mix of requests coming and
going; over two tensor-parallel ranks or two pipeline stages, one rank's tokens."""

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
from helpers.hybrid import (
    assert_chunked_form_keeps_tokens,
    assert_preemption_and_forks_keep_tokens,
    assert_speculation_keeps_tokens,
    randomize,
)

from pyengine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
SHAPE = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=256, layer_types=LAYER_TYPES,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=24, linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)  # fmt: skip
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48)  # fmt: skip
CONFIGS = {
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **SHAPE, **EXPERTS, intermediate_size=96, mlp_only_layers=[2], norm_topk_prob=False
    ),
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(**SHAPE, intermediate_size=96),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(**SHAPE, **EXPERTS),
}
ENGINE = dict(max_model_len=256, kv_cache_memory=32 * 2**20, dtype="float32")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hybrid(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, torch.nn.Module]:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        CONFIGS[request.param](), dtype=torch.float32
    )
    randomize(model, one_plus=True)  # (norms that scale by 1 + w; the gated one by w)
    model.eval().save_pretrained(folder)
    return request.param, folder, model


def test_greedy_tokens_and_logits_match_transformers(hybrid) -> None:  # type: ignore[no-untyped-def]
    """Chunks of 7 tokens cut through every prompt, beside the other requests' decodes."""
    _, folder, model = hybrid
    llm = LLM(str(folder), max_num_batched_tokens=7, **ENGINE)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert runner.kv_layout.groups == (("full", 0),) and runner.kv_slots == [0]
    assert len(runner.state_layers) == 3 and runner.num_state_slots == 256
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n).tolist() for n in (1, 3, 20, 90)]
    assert_tokens_and_logits_match(llm, model, prompts, rng.integers(0, 256, 70).tolist())


def test_prefills_by_chunks_keep_the_tokens(hybrid) -> None:  # type: ignore[no-untyped-def]
    _, folder, model = hybrid
    assert_chunked_form_keeps_tokens(folder, model, ENGINE)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_parallel_samples_keep_the_tokens(hybrid, mode: str) -> None:  # type: ignore[no-untyped-def]
    """Requests preempted are recomputed (their slots freed, their states computed
    again) or swapped out (their blocks to the host tier, their states kept in their
    slots), and each gets transformers' tokens (helpers/hybrid.py)."""
    _, folder, model = hybrid
    swap = {"preemption_mode": mode, "kv_offload_gb": 0.01 if mode == "swap" else 0}
    llm = assert_preemption_and_forks_keep_tokens(folder, model, ENGINE, **swap)
    assert (llm.llm_engine.scheduler.stats().num_swapped_preemptions > 0) == (mode == "swap")


def test_a_prefix_hit_resumes_the_state_from_a_checkpoint(hybrid) -> None:  # type: ignore[no-untyped-def]
    """A prompt's last full block ends a step of its own, where the state is
    checkpointed; a later prompt sharing 40 of its tokens hits its first two blocks of
    16 (the last with a checkpoint), resumes from there, and gets transformers' tokens;
    so does a next turn, from a checkpoint its answer's decode left; with a host tier,
    prefix caching is off."""
    _, folder, model = hybrid
    llm = LLM(str(folder), **ENGINE)
    assert llm.llm_engine.config.enable_prefix_caching
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert runner.num_state_checkpoints == runner.num_state_slots
    rng = np.random.default_rng(8)
    shared = rng.integers(0, 256, 45).tolist()
    second = shared[:40] + rng.integers(0, 256, 9).tolist()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    answers = []
    for prompt, cached in ((shared, 0), (second, 32), (second, 48)):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert out.num_cached_tokens == cached
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 12)
        answers.append(list(out.outputs[0].token_ids))
    # A next turn: the first answer's decode passed position 48, where its state was
    # checkpointed too.
    turn = shared + answers[0] + [7]
    (out,) = llm.generate([{"prompt_token_ids": turn}], params, use_tqdm=False)
    assert out.num_cached_tokens == 48
    assert out.outputs[0].token_ids == hf_greedy(model, turn, 12)
    offloading = LLM(str(folder), kv_offload_gb=0.01, **ENGINE)
    assert not offloading.llm_engine.config.enable_prefix_caching


@pytest.mark.parametrize(("interval", "cached"), [(1, 48), (2, 32)])
def test_checkpoints_every_k_blocks(hybrid, interval: int, cached: int) -> None:  # type: ignore[no-untyped-def]
    """Prefill chunks of 16 tokens: a 70-token prompt leaves a checkpoint at every block
    (interval 1), or at every second block and its last full one (interval 2, chunks cut
    there); a prompt sharing 55 of its tokens resumes from the last at or before 48."""
    _, folder, model = hybrid
    llm = LLM(str(folder), max_num_batched_tokens=16, state_checkpoint_interval=interval,
              **ENGINE)  # fmt: skip
    rng = np.random.default_rng(9)
    first = rng.integers(0, 256, 70).tolist()
    second = first[:55] + rng.integers(0, 256, 6).tolist()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for prompt, hit in ((first, 0), (second, cached)):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert out.num_cached_tokens == hit
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 6)
    with pytest.raises(ValueError, match="state_checkpoint_interval"):
        LLM(str(folder), state_checkpoint_interval=0, **ENGINE)


def test_speculative_decoding_puts_the_state_back_where_a_draft_is_rejected(hybrid) -> None:  # type: ignore[no-untyped-def]
    _, folder, model = hybrid
    assert_speculation_keeps_tokens(folder, model, ENGINE)


def test_draft_models_with_states_and_adapters_are_refused_by_name(hybrid) -> None:  # type: ignore[no-untyped-def]
    _, folder, _ = hybrid
    spec = {"method": "draft_model", "draft_layers": 1, "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="draft_layers: .* recurrent-state layers"):
        LLM(str(folder), speculative_config=spec, **ENGINE)
    with pytest.raises(ValueError, match="enable_lora: LoRA adapters on .* recurrent-state"):
        LLM(str(folder), enable_lora=True, **ENGINE)


@pytest.mark.slow
def test_two_ranks_give_one_ranks_tokens(hybrid) -> None:  # type: ignore[no-untyped-def]
    _, folder, _ = hybrid
    assert_ranks_give_one_ranks_tokens(
        folder, ENGINE, [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}]
    )
