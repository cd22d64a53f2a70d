"""Sampling under speculative decoding follows the target's distribution: on a tiny Llama
of 8 tokens, the empirical joint distribution of a request's first three sampled tokens
with prompt-lookup drafts and with a draft of the target's first layer (some accepted,
some rejected and resampled, up to two a step, the third token often a verifying step's
own) matches the exact one transformers
computes on the same weights, within a chi-square bound; and so does the same engine
without speculation."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.chi_square import chi_square, chi_square_bound

from pyengine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB = 8
TEMPERATURE, TOP_K, PRESENCE = 0.9, 6, 0.5
SAMPLES = 20_000


@pytest.fixture(scope="module")
def small_vocab(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, torch.nn.Module, list[int]]:
    """The model's folder, the model, and a prompt: its own greedy continuation of one
    token (of at least 3 tokens), which a tiny model soon repeats, so that prompt lookup
    proposes what it samples often (and often not)."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # peaked enough that drafts are often right, and often not
        for name, p in model.named_parameters():
            if p.dim() == 2:  # (the layers after the first add less: its drafts are fair)
                later = "layers." in name and not name.startswith("model.layers.0.")
                small = later and name.endswith(("o_proj.weight", "down_proj.weight"))
                p.normal_(0.0, 0.08 if small else 0.25)
    folder = tmp_path_factory.mktemp("small-vocab")
    model.save_pretrained(folder)
    for first in range(VOCAB):  # (one that does not repeat a single token)
        with torch.no_grad():
            greedy = model.generate(torch.tensor([[first]]), max_new_tokens=11, do_sample=False)
        if len(set(greedy[0].tolist())) >= 3:
            break
    return folder, model, greedy[0].tolist()


def processed(logits: torch.Tensor, outputs: tuple[int, ...]) -> np.ndarray:
    """The sampler's distribution, in float64: presence penalty on the output tokens,
    temperature, then the top-k."""
    x = logits.double().clone()
    for t in set(outputs):
        x[t] -= PRESENCE
    x = x / TEMPERATURE
    kth = x.topk(TOP_K).values[-1]
    x[x < kth] = -math.inf
    return torch.softmax(x, dim=-1).numpy()


def exact_joint(model: torch.nn.Module, prompt: list[int]) -> np.ndarray:
    """P(y1, y2, y3) [VOCAB, VOCAB, VOCAB]: every two-token continuation in one batch."""
    pairs = list(itertools.product(range(VOCAB), repeat=2))
    ids = torch.tensor([prompt + list(pair) for pair in pairs])
    with torch.no_grad():
        logits = model(ids).logits[:, -3:]  # predicting y1, y2 and y3
    joint = np.zeros((VOCAB,) * 3)
    for row, (a, b) in enumerate(pairs):
        first = processed(logits[row, 0], ())[a]
        second = processed(logits[row, 1], (a,))[b]
        joint[a, b] = first * second * processed(logits[row, 2], (a, b))
    return joint


def sampled_joint(
    folder: Path,
    prompt: list[int],
    speculative_config: dict[str, object] | None,
) -> tuple[np.ndarray, LLM]:
    llm = LLM(
        str(folder), max_model_len=64, kv_cache_memory=2**24, max_num_seqs=256, seed=7,
        speculative_config=speculative_config,
    )  # fmt: skip
    params = SamplingParams(
        n=100, temperature=TEMPERATURE, top_k=TOP_K, presence_penalty=PRESENCE,
        max_tokens=4, ignore_eos=True,  # (the first step after the prompt verifies 2)
    )  # fmt: skip
    prompts = [{"prompt_token_ids": prompt}] * (SAMPLES // params.n)
    counts = np.zeros((VOCAB,) * 3, dtype=np.int64)
    for output in llm.generate(prompts, params, use_tqdm=False):
        for sample in output.outputs:
            counts[tuple(sample.token_ids[:3])] += 1
    return counts, llm


@pytest.mark.parametrize("method", ["ngram", "draft_layers", "none"])
def test_sampled_tokens_follow_the_targets_distribution(
    small_vocab: tuple[Path, torch.nn.Module, list[int]], method: str
) -> None:
    folder, model, prompt = small_vocab
    speculative = method != "none"
    config: dict[str, object] = {"method": method, "num_speculative_tokens": 3,
                                 "disable_by_batch_size": 256}  # fmt: skip
    if method == "draft_layers":  # (greedy drafts of the target's first layer)
        config = {**config, "method": "draft_model", "draft_layers": 1}
    counts, llm = sampled_joint(folder, prompt, config if speculative else None)
    assert counts.sum() == SAMPLES
    stat, degrees = chi_square(counts, exact_joint(model, prompt))
    assert degrees > 50  # (the joint is spread: most cells are tested on their own)
    assert stat < chi_square_bound(degrees), (stat, degrees)
    stats = llm.llm_engine.core.spec_stats
    if speculative:  # drafts verified, kept and rejected, at the first place and the second
        assert stats.num_drafts > SAMPLES // 2
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert stats.accepted_per_position[1] > 0
    assert llm.llm_engine.scheduler.kv_cache.num_free_blocks == llm.llm_engine.executor.num_blocks
