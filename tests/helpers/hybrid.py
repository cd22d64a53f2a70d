"""What the tests of hybrid models with recurrent state share: random parameters for a
tiny transformers model (decays, steps and skips about 0, norms that scale by 1 + w
about 0 or by w about 1), and preemption and parallel samples under a pool one block
more than a max_model_len request holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from helpers.hf_reference import hf_greedy

# The gated norms inside the mixers, which scale by w (the others by 1 + w where
# `one_plus` says).
_MIXER_NORMS = ("linear_attn.norm.weight", "mamba.norm.weight", "mixer.norm.weight")


def randomize(model: torch.nn.Module, one_plus: bool = False) -> None:
    """Every parameter random: A_log, dt_bias and D about 0 (decays and steps of every
    size), norms about 1 (about 0 where they scale by 1 + w: `one_plus`, but the
    mixers' own), the rest small."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", ".D")):
                p.normal_(0.0, 1.0)
            elif "norm" in name and (not one_plus or name.endswith(_MIXER_NORMS)):
                p.uniform_(0.5, 1.5)
            elif "norm" in name:
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.1)


def assert_preemption_and_forks_keep_tokens(
    folder: Path, model: torch.nn.Module, engine: dict[str, Any], **options: Any
) -> Any:
    """A KV pool of one block more than a request of max_model_len 128 may hold, beside
    two requests' states: of three prompts of 50-70 tokens (any two need 11 blocks),
    requests are preempted and each gets transformers' greedy tokens; n = 2 forks a
    state and both samples go on from it; nothing is held after. Returns the LLM."""
    from pyengine import LLM
    from pyengine.worker.state_pool import slot_bytes

    probe = LLM(str(folder), **engine)
    runner = probe.llm_engine.executor.driver_worker.model_runner
    block, state = runner.block_bytes, slot_bytes(runner.state_layers)
    probe.llm_engine.shutdown()
    blocks = runner.kv_layout.max_blocks_held(128, 32, 16) + 1
    # (without prefix caching, whose checkpoints would take half the states' budget)
    limits = {"kv_cache_memory": blocks * block + 2 * state, "max_model_len": 128,
              "max_num_batched_tokens": 32, "max_num_seqs": 2,
              "enable_prefix_caching": False}  # fmt: skip
    llm = LLM(str(folder), **{**engine, **limits, **options})
    assert_generations_and_forks(llm, model)
    assert llm.llm_engine.scheduler.stats().num_preemptions > 0
    return llm


def assert_generations_and_forks(llm: Any, model: torch.nn.Module) -> None:
    """Through an LLM of two state slots: three prompts of 50-70 tokens each get
    transformers' 20 greedy tokens; n = 2 forks a state and both samples go on from it;
    nothing is held after."""
    from pyengine import SamplingParams

    assert llm.llm_engine.executor.driver_worker.model_runner.num_state_slots == 2
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, n).tolist() for n in (50, 60, 70)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 20)
    two = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2)
    (pair,) = llm.generate([{"prompt_token_ids": prompts[0]}], two, use_tqdm=False)
    want = hf_greedy(model, prompts[0], 10)
    assert [c.token_ids for c in pair.outputs] == [want, want]
    kv = llm.llm_engine.scheduler.kv_cache  # (nothing held after)
    assert kv.num_free_blocks == llm.llm_engine.executor.num_blocks
    assert kv.num_free_state_slots == 2


def assert_chunked_form_keeps_tokens(folder: Path, model: torch.nn.Module,
                                     engine: dict[str, Any]) -> None:  # fmt: skip
    """Every run of tokens through the recurrent kernels' chunked form (prefill's, 64
    tokens a chunk; pinned for every run, decodes' single tokens too): prompts of a
    partial chunk, a whole one and two and a part give transformers' tokens and logits."""
    from helpers.hf_reference import assert_tokens_and_logits_match
    from pyengine import _C, LLM

    _C.set_recurrent_chunks_from(1)
    try:
        llm = LLM(str(folder), **engine)
        rng = np.random.default_rng(3)
        prompts = [rng.integers(0, 256, n).tolist() for n in (5, 64, 150)]
        assert_tokens_and_logits_match(llm, model, prompts, rng.integers(0, 256, 200).tolist())
    finally:
        _C.set_recurrent_chunks_from(0)


def assert_speculation_keeps_tokens(folder: Path, model: torch.nn.Module,
                                    engine: dict[str, Any]) -> Any:  # fmt: skip
    """Suffix decoding's drafts verified by a hybrid model: a prompt, then it again (its
    first answer's drafts, accepted) beside one that differs in its last token (drafts
    rejected where its answer parts from the first). Each rejected draft's state is put
    back from its snapshot and the accepted tokens run again, so that every request gets
    transformers' greedy tokens. Returns the engine's stats."""
    from pyengine import LLM, SamplingParams

    spec = {"method": "suffix", "num_speculative_tokens": 4}
    llm = LLM(str(folder), speculative_config=spec, **engine)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert runner.num_state_snapshots == runner.num_state_slots > 0
    first = np.random.default_rng(4).integers(0, 256, 12).tolist()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for prompts in ([first], [first, first[:-1] + [(first[-1] + 1) % 256]]):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            assert list(out.outputs[0].token_ids) == hf_greedy(model, prompt, 32)
    stats = llm.llm_engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, stats
    return stats
