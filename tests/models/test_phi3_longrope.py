"""Phi-3's LongRoPE rotary scaling (its short factors within the original context, its
long ones past it, and the attention factor from max_position_embeddings over the
original) on a tiny random checkpoint transformers makes: greedy float32 tokens and
logits are transformers', with max_model_len on either side of the original context."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.hf_reference import hf_greedy, prefill_logits

from pyengine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

ORIGINAL = 64


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("phi3-longrope")
    rng = np.random.default_rng(0)
    scaling = {
        "type": "longrope",  # (Phi-3's own spelling; the original context beside it)
        "short_factor": (1 + rng.random(16)).tolist(),
        "long_factor": (2 + 6 * rng.random(16)).tolist(),
    }
    config = transformers.Phi3Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        original_max_position_embeddings=ORIGINAL, rope_scaling=scaling, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    return folder, model


@pytest.mark.parametrize("max_model_len", [ORIGINAL, 256], ids=["short", "long"])
def test_longrope_matches_transformers(phi3, max_model_len: int) -> None:  # type: ignore[no-untyped-def]
    folder, model = phi3
    llm = LLM(str(folder), max_model_len=max_model_len, kv_cache_memory=16 * 2**20,
              dtype="float32")  # fmt: skip
    rng = np.random.default_rng(1)
    # (within the original context for the short factors, past it for the long ones, as
    # transformers chooses them by each forward's length)
    lengths = (5, 30) if max_model_len == ORIGINAL else (70, 120)
    new = 12 if max_model_len == ORIGINAL else 20
    prompts = [rng.integers(0, 256, n).tolist() for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, new)
    tokens = rng.integers(0, 256, max(lengths)).tolist()
    with torch.inference_mode():
        theirs = model(torch.tensor([tokens])).logits[0]
    assert (prefill_logits(llm, tokens) - theirs).abs().max().item() < 1e-4
