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
from helpers.tiny_deepseek import deepseek_checkpoint, deepseek_config

from pyengine import LLM
from pyengine.layers.latent_attention import EXPANDED_FROM

transformers = pytest.importorskip("transformers")

ENGINE = dict(max_model_len=256, kv_cache_memory=32 * 2**20, dtype="float32")


@pytest.fixture(scope="module", params=["v2", "v3"])
def deepseek(request, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp(f"deepseek-{request.param}")
    model = deepseek_checkpoint(deepseek_config(request.param), folder)
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


def test_long_prefills_take_the_expanded_form(deepseek, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Requests of at least `expanded_from` query tokens in a step attend in the expanded
    form, beside the others' absorbed one in the same step (decode steps, short chunks):
    transformers' tokens and logits still, through chunked prefill and a prefix hit."""
    from pyengine.models import deepseek as module

    _, folder, model = deepseek
    calls = []

    def counted(*args):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape[0])
        return expanded_attention(*args)

    expanded_attention = module.expanded_attention
    monkeypatch.setattr(module, "expanded_attention", counted)
    llm = LLM(str(folder), max_num_batched_tokens=48, **ENGINE)
    for layer in llm.llm_engine.executor.driver_worker.model_runner.model.layers:
        layer.self_attn.attn.expanded_from = dict.fromkeys(EXPANDED_FROM, 8)
    rng = np.random.default_rng(4)
    shared = rng.integers(0, 256, 40).tolist()
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 12, 100)] + [shared, shared + [7] * 20]
    assert_tokens_and_logits_match(llm, model, prompts, rng.integers(0, 256, 100).tolist())
    assert calls and min(calls) >= 8 and len(calls) % 3 == 0  # (each of the 3 layers)


def logprob_differences(folder, lengths: list[int], seed: int, engines: list[dict]):  # type: ignore[no-untyped-def]
    """The top-5 logprobs' differences between two engines (each LLM's arguments over
    ENGINE's; each checks its engine first, given it) over greedy 10-token completions of
    random prompts of `lengths`, at each step whose tokens so far agree."""
    from helpers.logprobs import same_context_differences

    from pyengine import SamplingParams

    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": rng.integers(0, 256, n).tolist()} for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    runs = []
    for engine in engines:
        check = engine.pop("check", None)
        llm = LLM(str(folder), **{**ENGINE, **engine})
        if check is not None:
            check(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.llm_engine.shutdown()
        runs.append([(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs])
    return same_context_differences(*runs)


def test_an_fp8_latent_cache_stays_close_to_the_float_one(deepseek) -> None:  # type: ignore[no-untyped-def]
    """kv_cache_dtype="fp8": each latent vector stored as e4m3 (a byte a number, unscaled,
    as vLLM's fp8 latent cache), read back by both forms; the top-5 logprobs within what
    e4m3's 3 mantissa bits cost, at each step whose tokens so far agree."""

    def cache_of(dtype: torch.dtype):  # type: ignore[no-untyped-def]
        def check(llm):  # type: ignore[no-untyped-def]
            caches = llm.llm_engine.executor.driver_worker.model_runner.caches
            assert caches[0][0].dtype == dtype

        return check

    _, folder, _ = deepseek
    differences = logprob_differences(folder, [5, 60], 8, [
        {"kv_cache_dtype": "fp8", "check": cache_of(torch.uint8)},
        {"kv_cache_dtype": "auto", "check": cache_of(torch.float32)},
    ])  # fmt: skip
    assert len(differences) >= 2 * 5
    assert max(differences) < 0.4 and sum(differences) / len(differences) < 0.1
    assert max(differences) > 0  # (the cache did round)


def test_bfloat16_latent_attention_stays_close_to_float32(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """bfloat16 at MLA's lane shapes (a latent of 32 + 32, values of 32): latent attention
    on the build this CPU runs (AMX's tiles, AVX512-BF16's dot products or the portable
    loops) for prefill and decode; the top-5 logprobs within bfloat16's rounding of the
    float32 run's, at each step whose tokens so far agree."""
    from pyengine import _C

    deepseek_checkpoint(deepseek_config("v2", qk_rope_head_dim=32), tmp_path)
    assert _C.mla_bf16_build(4, 64, 32, 16) in ("amx", "avx512_bf16", "portable")
    differences = logprob_differences(
        tmp_path, [5, 60, 150], 9, [{"dtype": "bfloat16"}, {"dtype": "float32"}]
    )
    assert len(differences) >= 3 * 5
    assert max(differences) < 0.3 and sum(differences) / len(differences) < 0.05
