"""Gemma 2 (Gemma2ForCausalLM) on tiny random checkpoints that transformers makes in the
test: random norms (Gemma's 1 + w), a window smaller than the prompts on alternating
layers, soft-capped attention and final logits, a query scale of its own. Greedy float32
tokens and logits identical to transformers', with chunked prefill, a shared prefix and
forced preemption; over two ranks, one rank's tokens; a config it cannot run refused by
name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.hf_reference import hf_greedy, prefill_logits

from pyengine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

WINDOW = 16
CONFIG = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
    sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
    final_logit_softcapping=5.0,
)  # fmt: skip
ENGINE = dict(max_model_len=256, kv_cache_memory=32 * 2**20, dtype="float32")


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("gemma2")
    torch.manual_seed(0)
    config = transformers.Gemma2Config(**CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # (norms' w random about 0: Gemma scales by 1 + w)
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.08)
    model.eval().save_pretrained(folder)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    return folder, model


def test_greedy_tokens_and_logits_match_transformers(gemma2) -> None:  # type: ignore[no-untyped-def]
    folder, model = gemma2
    llm = LLM(str(folder), max_num_batched_tokens=32, **ENGINE)  # (chunked prefill)
    layers = llm.llm_engine.executor.driver_worker.model_runner.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [WINDOW, 0] * 2
    rng = np.random.default_rng(2)
    shared = rng.integers(0, 256, 40).tolist()
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 20, 90)] + [shared, shared + [5]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 12)
    tokens = rng.integers(0, 256, 70).tolist()  # (past the window)
    with torch.inference_mode():
        theirs = model(torch.tensor([tokens])).logits[0]
    assert (prefill_logits(llm, tokens) - theirs).abs().max().item() < 1e-4


def test_preemption_keeps_the_tokens(gemma2) -> None:  # type: ignore[no-untyped-def]
    folder, model = gemma2
    block = 4 * 2 * 2 * 32 * 16 * 4  # 4 layers' K and V of 16 tokens, float32
    llm = LLM(str(folder), **{**ENGINE, "kv_cache_memory": 9 * block, "max_model_len": 128})
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, n).tolist() for n in (30, 45, 60)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 20)
    assert llm.llm_engine.scheduler.stats().num_preemptions > 0


@pytest.mark.slow
def test_two_ranks_give_one_ranks_tokens(gemma2) -> None:  # type: ignore[no-untyped-def]
    folder, _ = gemma2
    prompts = [list(range(3, 60)), [9, 8, 7]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        llm = LLM(str(folder), tensor_parallel_size=tp, **ENGINE)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
        llm.llm_engine.shutdown()
    assert runs[0] == runs[1]


def test_what_it_cannot_run_is_refused_by_name(gemma2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder, _ = gemma2
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    for change, message in (
        ({"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
        ({"layer_types": ["chunked_attention"] * 4}, r"layer_types \['chunked_attention'\]"),
        ({"layer_types": ["full_attention"]}, "layer_types must name each of the 4 layers"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            LLM(str(tmp_path), **ENGINE)
