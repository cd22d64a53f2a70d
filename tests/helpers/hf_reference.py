"""References for the model tests: Hugging Face transformers on the same weights, and
pyengine's own model run over a whole sequence at once."""

from __future__ import annotations

from typing import Any

import torch

from pyengine import LLM
from pyengine.config import ModelConfig
from pyengine.layers.attention import AttentionMetadata


def hf_config(c: ModelConfig) -> object:
    import transformers

    kinds = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
    }
    return kinds[c.architecture](
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_size,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta,
        rope_scaling=c.rope_scaling,
        tie_word_embeddings=c.tie_word_embeddings,
    )


def hf_model_from_weights(c: ModelConfig, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(hf_config(c), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected, unexpected
    assert all("lm_head" in m for m in missing), missing  # tied to the embeddings
    return model.eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' generate, greedy, exactly new_tokens tokens (no EOS stop), on the
    model's device."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def prefill_logits(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """Every position's logits, one request through the paged cache (blocks 0, 1, ...,
    then the next KV-cache group's after them) and, in a hybrid model, state slot 0."""
    runner = llm.llm_engine.executor.driver_worker.model_runner
    n = len(tokens)
    blocks = -(-n // runner.block_size)
    groups = torch.arange(len(runner.kv_layout.groups))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64)
        + (groups * blocks * runner.block_size)[:, None],
        block_tables=(torch.arange(blocks, dtype=torch.int32) + groups[:, None] * blocks)[
            :, None
        ].int(),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
    )
    if runner.num_state_slots:
        meta.states = runner.states_by_virtual_engine[0]
        meta.state_slots = torch.zeros(1, dtype=torch.int32)
        meta.has_state = torch.zeros(1, dtype=torch.int32)
    with torch.inference_mode():
        hidden = runner.model(
            torch.tensor(tokens), torch.arange(n, dtype=torch.int32), runner.caches, meta
        )
        return runner.model.compute_logits(hidden)


def assert_tokens_and_logits_match(
    llm: LLM, model: torch.nn.Module, prompts: list[list[int]], tokens: list[int]
) -> torch.Tensor:
    """Float32: 12 greedy tokens of each prompt transformers', and every position's logits
    of `tokens`, one request through the paged cache, within 1e-4 of its; returns its."""
    from pyengine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 12)
    with torch.inference_mode():
        theirs: torch.Tensor = model(torch.tensor([tokens])).logits[0]
    assert (prefill_logits(llm, tokens) - theirs).abs().max().item() < 1e-4
    return theirs


def assert_preemption_keeps_tokens(
    folder: Any,
    model: torch.nn.Module,
    specs: list[tuple[str, int]],
    engine: dict[str, Any],
    latent: int = 0,
) -> Any:
    """A KV pool of one block more than a request of max_model_len 128 may hold (in
    chunks of 32 tokens), for three prompts of 30-60 tokens (a model of layers of 2 kv
    heads of 32, float32, whose layers attend as these KV specs say): requests are
    preempted and computed again, and each gets transformers' greedy tokens."""
    import numpy as np

    from pyengine import LLM, SamplingParams
    from pyengine.worker.kv_layout import plan_kv_layout

    layout = plan_kv_layout(specs)
    per_token = latent or 2 * 2 * 32  # each slot's K and V of 2 heads of 32, or its latent
    block = layout.num_slots * per_token * 16 * 4
    blocks = layout.max_blocks_held(128, 32, 16) + 1
    options = {"kv_cache_memory": blocks * block, "max_model_len": 128,
               "max_num_batched_tokens": 32, "enable_chunked_prefill": True}  # fmt: skip
    llm = LLM(str(folder), **{**engine, **options})
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, n).tolist() for n in (30, 45, 60)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 20)
    assert llm.llm_engine.scheduler.stats().num_preemptions > 0
    return llm  # (the LLM, for a caller's further checks)


def assert_ranks_give_one_ranks_tokens(
    folder: Any, engine: dict[str, Any], layouts: list[dict[str, Any]]
) -> None:
    """Greedy tokens of two prompts at one rank, then under each of `layouts` (engine
    options: tensor_parallel_size, enable_expert_parallel...), all the same."""
    from pyengine import LLM, SamplingParams

    prompts = [list(range(3, 60)), [9, 8, 7]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runs = []
    for options in [{}, *layouts]:
        llm = LLM(str(folder), **{**engine, **options})
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
        llm.llm_engine.shutdown()
    assert all(run == runs[0] for run in runs[1:])
