"""Gemma 2 and Gemma 3 (text) on tiny random checkpoints that transformers makes in the
test: random norms (Gemma's 1 + w), a window smaller than the prompts on alternating
layers (Gemma 2) or five of six (Gemma 3, whose sliding layers have a rotary base of
their own and whose global ones scale theirs), soft-capped attention and final logits
(Gemma 2), per-head q/k norms (Gemma 3), a query scale of their own. Greedy float32
tokens and logits identical to transformers', with chunked prefill, a shared prefix and
forced preemption; over two ranks, one rank's tokens; a config it cannot run refused by
name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.hf_reference import (
    assert_preemption_keeps_tokens,
    assert_ranks_give_one_ranks_tokens,
    assert_tokens_and_logits_match,
    hf_greedy,
)

from pyengine import LLM, SamplingParams
from pyengine.worker.kv_layout import plan_kv_layout

transformers = pytest.importorskip("transformers")

WINDOW = 16
SHAPE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=256, sliding_window=WINDOW,
    query_pre_attn_scalar=24,
)  # fmt: skip
CONFIGS = {
    "gemma2": lambda: transformers.Gemma2Config(
        **SHAPE, num_hidden_layers=4, attn_logit_softcapping=3.0, final_logit_softcapping=5.0
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SHAPE, num_hidden_layers=6, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        },
    ),
}  # fmt: skip
# Each layer's window (0: global).
WINDOWS = {"gemma2": [WINDOW, 0] * 2, "gemma3": [WINDOW] * 5 + [0]}
ENGINE = dict(max_model_len=256, kv_cache_memory=32 * 2**20, dtype="float32")


def specs(windows: list[int]) -> list[tuple[str, int]]:
    """The layers' KV specs (worker/kv_layout.py)."""
    return [("sliding", w) if w else ("full", 0) for w in windows]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def gemma(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, torch.nn.Module]:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        CONFIGS[request.param](), dtype=torch.float32
    )
    with torch.no_grad():  # (norms' w random about 0: Gemma scales by 1 + w)
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.08)
    model.eval().save_pretrained(folder)
    return request.param, folder, model


def test_greedy_tokens_and_logits_match_transformers(gemma) -> None:  # type: ignore[no-untyped-def]
    kind, folder, model = gemma
    llm = LLM(str(folder), max_num_batched_tokens=32, **ENGINE)  # (chunked prefill)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    layers = runner.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == WINDOWS[kind]
    assert runner.graphs is not None  # (its decode steps recorded: kernels only)
    rng = np.random.default_rng(2)
    shared = rng.integers(0, 256, 40).tolist()
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 20, 90)] + [shared, shared + [5]]
    tokens = rng.integers(0, 256, 70).tolist()  # (past the window)
    assert_tokens_and_logits_match(llm, model, prompts, tokens)


def test_preemption_keeps_the_tokens(gemma) -> None:  # type: ignore[no-untyped-def]
    kind, folder, model = gemma
    assert_preemption_keeps_tokens(folder, model, specs(WINDOWS[kind]), ENGINE)


def test_every_kv_cache_feature_keeps_the_tokens_over_windows(gemma) -> None:  # type: ignore[no-untyped-def]
    """The hybrid KV cache (a block table per group, windows releasing blocks) under
    prefix caching, chunked prefill, preemption by swapping into the host tier,
    prompt-lookup speculation (drafts rolled back) and parallel samples (forked tables,
    copy-on-write): transformers' greedy tokens, in a pool one max_model_len request
    nearly fills."""
    kind, folder, model = gemma
    layout = plan_kv_layout(specs(WINDOWS[kind]))
    block = layout.num_slots * 2 * 2 * 32 * 16 * 4
    blocks = layout.max_blocks_held(128, 32, 16) + 1
    options = {"max_model_len": 128, "kv_cache_memory": blocks * block,
               "max_num_batched_tokens": 32, "enable_chunked_prefill": True,
               "kv_offload_gb": 0.01, "preemption_mode": "swap",
               "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}  # fmt: skip
    llm = LLM(str(folder), **{**ENGINE, **options})
    rng = np.random.default_rng(5)
    span = rng.integers(0, 256, 9).tolist()
    shared = (span * 4)[:30]  # (repeats: prompt lookup proposes)
    prompts = [shared + rng.integers(0, 256, n).tolist() for n in (5, 15, 25, 35, 45)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 40)
    stats = llm.llm_engine.scheduler.stats()
    assert stats.num_swapped_preemptions > 0 and stats.prefix_cache_hits > 0
    assert llm.llm_engine.core.spec_stats.num_accepted_tokens > 0
    two = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, n=2)
    (pair,) = llm.generate([prompts[1]], two, use_tqdm=False)
    want = hf_greedy(model, prompts[1], 16)
    assert [c.token_ids for c in pair.outputs] == [want, want]


@pytest.mark.slow
def test_two_ranks_give_one_ranks_tokens(gemma) -> None:  # type: ignore[no-untyped-def]
    _, folder, _ = gemma
    assert_ranks_give_one_ranks_tokens(folder, ENGINE, [{"tensor_parallel_size": 2}])


def test_what_it_cannot_run_is_refused_by_name(gemma, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    kind, folder, _ = gemma
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    layers = len(WINDOWS[kind])
    for change, message in (
        ({"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
        ({"layer_types": ["chunked_attention"] * layers}, r"layer_types \['chunked_attention'\]"),
        ({"layer_types": ["full_attention"]}, f"layer_types must name each of the {layers} "),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            LLM(str(tmp_path), **ENGINE)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_quantized_checkpoint_gives_the_dequantized_models_tokens(
    gemma, tmp_path: Path, method: str
) -> None:  # type: ignore[no-untyped-def]
    """4-bit GPTQ and AWQ through the existing methods: every projection's blocks, the
    windows and soft-caps as the float model's, so the tokens are transformers' on the
    dequantized weights."""
    from helpers.hf_reference import hf_greedy
    from helpers.quantized_checkpoints import write_quantized

    from pyengine.layers.quantization.weight_only_int import WeightOnlyIntMethod

    _, folder, _ = gemma
    write_quantized(folder, tmp_path / "q", tmp_path / "ref", method, 4, 32)
    llm = LLM(str(tmp_path / "q"), **ENGINE)
    layer = llm.llm_engine.executor.driver_worker.model_runner.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.method, WeightOnlyIntMethod)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 40)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)  # (past the window)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.shutdown()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ref", dtype=torch.float32
    )
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        hf_greedy(reference, p, 30) for p in prompts
    ]


def test_lora_adapters_give_peft_tokens(gemma, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A random adapter of every projection (peft's layout): the attention's through the
    windows and soft-caps, gate and up through GeGLU; peft's greedy tokens, beside the base
    model's in the same batch."""
    pytest.importorskip("peft")
    from helpers.hf_reference import hf_greedy
    from helpers.lora import make_adapter

    from pyengine import LoRARequest

    _, folder, base = gemma
    fresh = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    adapted = make_adapter(fresh, tmp_path / "adapter", seed=3).eval()
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, n).tolist() for n in (6, 40)]
    llm = LLM(str(folder), enable_lora=True, max_lora_rank=8, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    inputs = [{"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(inputs * 2, params, lora_request=[lora, lora, None, None], use_tqdm=False)
    llm.llm_engine.shutdown()
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got[:2] == [hf_greedy(adapted, p, 20) for p in prompts]
    assert got[2:] == [hf_greedy(base, p, 20) for p in prompts]
    assert got[:2] != got[2:]
