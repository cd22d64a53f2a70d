"""Speculative decoding with prompt-lookup (n-gram) drafts: float32 greedy tokens
identical to no speculation on a tiny llama and on the default model, with prefix
caching, chunked prefill, n > 1, forced preemption, stop tokens, logprobs, penalties and
min_tokens; sampled tokens that follow the target's distribution (a chi-square bound on
a tiny vocabulary); drafts accepted; no block left; bad configurations refused at
start."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.replays import count_replays
from helpers.tiny_models import make_checkpoint

from pyengine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

# (drafts at every batch size these tests run: the CPU's default stops at 4 requests)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 64}
SUFFIX = {**NGRAM, "method": "suffix"}
DRAFT = {**NGRAM, "method": "draft_model"}
METHODS = pytest.mark.parametrize("method", ["ngram", "suffix", "draft_layers", "draft_model"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("spec") / "llama"
    make_checkpoint("llama", folder)
    return folder


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A Llama of 8 layers, whose first layer is a draft cheap enough to be worth its
    drafts (the draft budget weighs its cost) and often right, and that layer as a model
    of its own."""
    folder = tmp_path_factory.mktemp("spec-deep")
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # the layers after the first add little: often its tokens
        for name, p in model.named_parameters():
            if p.dim() == 2:
                later = not name.startswith("model.layers.0.") and "layers." in name
                p.normal_(
                    0.0,
                    0.02
                    if later and name.endswith(("o_proj.weight", "down_proj.weight"))
                    else 0.08,
                )
    model.save_pretrained(folder / "target")
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    model.save_pretrained(folder / "first-layer")
    return folder / "target", folder / "first-layer"


def target_and_config(method: str, tiny: Path, deep: tuple[Path, Path]) -> tuple[Path, dict]:  # type: ignore[type-arg]
    """A method's target and speculative_config. The draft model is the deep target's
    first layer, as a separate model (its own KV cache) or as draft_layers (the target's
    cache): the same drafts either way."""
    if method == "draft_layers":
        return deep[0], {**DRAFT, "draft_layers": 1}
    if method == "draft_model":
        return deep[0], {**DRAFT, "model": str(deep[1])}
    return tiny, {**NGRAM, "method": method}


def repeating_prompts(count: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """Prompts that repeat a span (as a rewrite's or an edit's input does): tiny random
    models then repeat too, so that prompt lookup proposes and is often right."""
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(count):
        span = rng.integers(0, 256, int(rng.integers(5, 15))).tolist()
        prompts.append({"prompt_token_ids": (span * 6)[: 20 + 3 * i]})
    return prompts


def replace_config(config: object, **changes: object) -> object:
    """A transformers config with some fields changed."""
    fields = {**config.to_dict(), **changes}  # type: ignore[attr-defined]
    return type(config)(**fields)


def tokens(outputs: list) -> list[list[int]]:  # type: ignore[type-arg]
    return [list(o.outputs[0].token_ids) for o in outputs]


def run(folder: Path, prompts: list, params: object, **engine: object) -> tuple[list, LLM]:  # type: ignore[type-arg]
    # dtype float32: the exact mode, in which verifying k drafts in one step gives the
    # tokens of k one-row steps (bfloat16 rounds products of many rows otherwise)
    options = {"max_model_len": 256, "kv_cache_memory": 2**22, "dtype": "float32", **engine}
    llm = LLM(str(folder), **options)  # type: ignore[arg-type]
    return llm.generate(prompts, params, use_tqdm=False), llm  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "engine",
    [{}, {"enable_prefix_caching": False}, {"max_num_batched_tokens": 24},
     {"kv_cache_memory": 2**18}, {"enforce_eager": True}],
    ids=["default", "no-prefix-cache", "chunked", "preempted", "eager"],
)  # fmt: skip
@METHODS
def test_greedy_tokens_are_those_of_no_speculation(
    tiny: Path,
    deep: tuple[Path, Path],
    engine: dict,
    method: str,  # type: ignore[type-arg]
) -> None:
    prompts = repeating_prompts(6)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    target, config = target_and_config(method, tiny, deep)
    if "kv_cache_memory" in engine and target != tiny:  # (4 times the layers, and a draft)
        engine = {**engine, "kv_cache_memory": 5 * engine["kv_cache_memory"]}
    plain, _ = run(target, prompts, params, **engine)
    spec_out, llm = run(target, prompts, params, speculative_config=config, **engine)
    assert tokens(spec_out) == tokens(plain)
    stats = llm.llm_engine.core.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert 1 < stats.mean_accepted_length <= 5
    totals = llm.llm_engine.stats()  # what /metrics exports (spec_decode_*)
    assert (totals.spec_num_drafts, totals.spec_num_accepted_tokens) == (
        stats.num_drafts, stats.num_accepted_tokens)  # fmt: skip
    assert sum(totals.spec_accepted_per_position) == stats.num_accepted_tokens
    if method == "draft_model":  # its own cache in step: draft_layers' drafts, as good
        layers = {**config, "model": None, "draft_layers": 1}
        _, same = run(target, prompts, params, speculative_config=layers, **engine)
        rate = same.llm_engine.core.spec_stats.acceptance_rate
        assert abs(stats.acceptance_rate - rate) < 0.05, (stats, rate)
    assert llm.llm_engine.scheduler.kv_cache.num_free_blocks == llm.llm_engine.executor.num_blocks
    if "kv_cache_memory" in engine:
        assert llm.llm_engine.scheduler.stats().num_preemptions > 0


@METHODS
def test_stop_tokens_n_logprobs_and_penalties_under_speculation(
    tiny: Path, deep: tuple[Path, Path], method: str
) -> None:
    """A stop token among the accepted drafts ends the request there; n > 1 samples,
    logprobs, penalties and min_tokens (whose logits rows after a draft count it as an
    output token) keep the tokens of no speculation, every request verifying drafts."""
    prompts = repeating_prompts(6, seed=1)
    target, config = target_and_config(method, tiny, deep)
    plain_out, _ = run(
        target, prompts[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )
    first = tokens(plain_out)[0]  # (a stop token the request reaches late, seen first there)
    stop = next(t for i, t in enumerate(first) if i >= 8 and t not in first[:i])
    params = [
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=0.4,
                       presence_penalty=0.2),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=20, stop_token_ids=[stop]),
    ]  # fmt: skip
    plain, _ = run(target, prompts, params)
    spec_out, llm = run(target, prompts, params, speculative_config=config)
    for a, b in zip(plain, spec_out, strict=True):
        assert [list(s.token_ids) for s in a.outputs] == [list(s.token_ids) for s in b.outputs]
        assert [s.finish_reason for s in a.outputs] == [s.finish_reason for s in b.outputs]
        assert b.metrics.num_draft_tokens > 0, b.request_id
    assert tokens(spec_out)[0][-1] == stop
    want, got = plain[2].outputs[0], spec_out[2].outputs[0]
    assert want.logprobs is not None and got.logprobs is not None
    assert len(got.logprobs) == len(got.token_ids)
    for a, b in zip(want.logprobs, got.logprobs, strict=True):  # (a step's rows round apart)
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
    stats = llm.llm_engine.core.spec_stats
    assert sum(o.metrics.num_accepted_tokens for o in spec_out) == stats.num_accepted_tokens
    assert sum(o.metrics.num_draft_tokens for o in spec_out) == stats.num_draft_tokens


@METHODS
def test_seeded_sampled_requests_give_the_tokens_of_no_speculation(
    tiny: Path, deep: tuple[Path, Path], method: str
) -> None:
    """Sampled requests verify drafts too (by their draws, accept_drafts). A seeded one
    draws for each place its own number (seeded_uniform), however many rows a step drew:
    its tokens are those of no speculation, in any batch."""
    prompts = repeating_prompts(3, seed=4)
    target, config = target_and_config(method, tiny, deep)
    params = [SamplingParams(temperature=t, top_k=20, seed=11 + i, max_tokens=30,
                             ignore_eos=True, presence_penalty=0.2)
              for i, t in enumerate((0.3, 0.8, 1.0))]  # fmt: skip
    plain, _ = run(target, prompts, params)
    spec_out, llm = run(target, prompts, params, speculative_config=config)
    assert tokens(spec_out) == tokens(plain)
    assert llm.llm_engine.core.spec_stats.num_accepted_tokens > 0
    assert all(o.metrics.num_draft_tokens > 0 for o in spec_out)
    alone, _ = run(target, prompts[1:2], params[1:2], speculative_config=config)
    assert tokens(alone) == tokens(plain)[1:2]


def test_suffix_decoding_proposes_earlier_outputs(tiny: Path) -> None:
    """A prompt that never repeats itself gives its own tree little to propose; asked
    again, the global tree holds the first answer, and proposes it. The global tree keeps
    at most suffix_decoding_max_cached_requests outputs; no request's tree outlives it."""
    rng = np.random.default_rng(3)
    prompt = {"prompt_token_ids": rng.permutation(256)[:40].tolist()}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    config = {**SUFFIX, "suffix_decoding_max_cached_requests": 3}
    first, llm = run(tiny, [prompt], params, speculative_config=config)
    before = llm.llm_engine.core.spec_stats.num_accepted_tokens
    again = llm.generate([prompt], params, use_tqdm=False)
    assert tokens(again) == tokens(first)
    accepted = again[0].metrics.num_accepted_tokens
    assert accepted > before and accepted >= 30, (accepted, before)
    llm.generate(repeating_prompts(5), params, use_tqdm=False)
    sizes = llm.llm_engine.scheduler.suffix_tree_sizes()
    assert sizes["cached_outputs"] == 3 and sizes["request_trees"] == 0, sizes


def test_verifying_steps_replay_as_decode_steps_do(tiny: Path) -> None:
    """On the CPU a step that verifies drafts runs a recorded program of its tokens (the
    same tokens as eager steps, the test above)."""
    prompts = repeating_prompts(3)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = LLM(str(tiny), max_model_len=256, kv_cache_memory=2**22, speculative_config=NGRAM)
    graphs = llm.llm_engine.executor.driver_worker.model_runner.graphs
    assert graphs is not None and graphs.max_query_len == 5
    replays = count_replays(graphs)
    llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.core.spec_stats.num_drafts > 0
    decoding = [(n, size) for n, size in replays[1:] if n == 3]  # (after the prefill)
    assert decoding and all(size is not None for _, size in decoding)
    assert any(size is not None and size > 3 for _, size in decoding)  # with drafts


def test_no_drafts_past_the_batch_size_that_disables_them(tiny: Path) -> None:
    """disable_by_batch_size: a step of more running requests proposes nothing; fewer
    do, with the same tokens either way."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    config = {**NGRAM, "disable_by_batch_size": 2}
    plain, _ = run(tiny, repeating_prompts(3), params)
    three, llm = run(tiny, repeating_prompts(3), params, speculative_config=config)
    assert tokens(three) == tokens(plain)
    assert llm.llm_engine.core.spec_stats.num_drafts == 0
    llm.generate(repeating_prompts(2), params, use_tqdm=False)
    assert llm.llm_engine.core.spec_stats.num_drafts > 0


@pytest.mark.parametrize(
    ("config", "message"),
    [({"method": "eagle", "num_speculative_tokens": 2}, "unknown method 'eagle'"),
     ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
     ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens must be"),
     ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
       "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
     ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown keys"),
     ({"num_speculative_tokens": 2}, "needs method"),
     ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a draft"),
     ({"method": "draft_model", "num_speculative_tokens": 2, "draft_layers": 1, "model": "m"},
      "needs a draft"),
     ({"method": "draft_model", "num_speculative_tokens": 2, "draft_layers": 2},
      "fewer than the target's 2 layers"),
     ({"method": "draft_model", "num_speculative_tokens": 2, "draft_layers": 0},
      "draft_layers must be a positive integer"),
     ({"method": "ngram", "num_speculative_tokens": 2, "draft_layers": 1},
      "method draft_model's"),
     ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 0},
      "suffix_decoding_max_tree_depth must be"),
     ({"method": "suffix", "num_speculative_tokens": 2,
       "suffix_decoding_max_cached_requests": -1}, "max_cached_requests must be"),
     ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_spec_factor": 0},
      "max_spec_factor must be"),
     ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 2},
      "min_token_prob must be"),
     ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
      "disable_by_batch_size must be a positive integer")],
)  # fmt: skip
def test_bad_configs_are_refused_at_start(tiny: Path, config: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny), max_model_len=64, kv_cache_memory=2**20, speculative_config=config)


def test_a_draft_of_another_architecture_and_of_another_vocabulary(
    deep: tuple[Path, Path], tmp_path: Path
) -> None:
    """A Qwen2 draft with the Llama target's vocabulary: the target's tokens; a draft of
    another vocabulary, or of fewer positions than max_model_len, is refused at start."""
    target = deep[0]
    make_checkpoint("qwen2", tmp_path / "qwen2")
    prompts = repeating_prompts(4, seed=5)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain, _ = run(target, prompts, params)
    config = {**DRAFT, "model": str(tmp_path / "qwen2")}
    spec_out, llm = run(target, prompts, params, speculative_config=config)
    assert tokens(spec_out) == tokens(plain)
    assert llm.llm_engine.core.spec_stats.num_drafts > 0
    assert llm.llm_engine.scheduler.kv_cache.num_free_blocks == llm.llm_engine.executor.num_blocks
    other = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=32)  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(other).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="vocabulary of 300 tokens, the target 256"):
        LLM(str(target), max_model_len=64, kv_cache_memory=2**20,
            speculative_config={**DRAFT, "model": str(tmp_path / "other")})  # fmt: skip
    short = replace_config(other, vocab_size=256, max_position_embeddings=32)
    transformers.AutoModelForCausalLM.from_config(short).save_pretrained(tmp_path / "short")
    with pytest.raises(ValueError, match="has 32 positions, fewer than max_model_len 64"):
        LLM(str(target), max_model_len=64, kv_cache_memory=2**20,
            speculative_config={**DRAFT, "model": str(tmp_path / "short")})  # fmt: skip


@pytest.mark.slow
def test_the_default_model_rewriting_its_prompt() -> None:
    """SmolLM2 asked to repeat a given text (its output repeats the prompt): the same
    greedy tokens with prompt lookup, suffix decoding (most drafts accepted) and the
    target's first 10 layers as a draft model."""
    from helpers.smollm2 import TEXT

    from pyengine.loader.resolve import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    texts = [f"Repeat this text exactly.\n\n{TEXT * k}\n\nThe text again:\n\n" for k in (1, 2)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(max_model_len=512, dtype="float32")  # (lossless exactly in float32)
    want = tokens(plain.generate(texts, params, use_tqdm=False))
    for method in (NGRAM, SUFFIX, {**DRAFT, "draft_layers": 10}):
        spec = LLM(max_model_len=512, speculative_config=method, dtype="float32")
        assert tokens(spec.generate(texts, params, use_tqdm=False)) == want
        stats = spec.llm_engine.core.spec_stats
        if method["method"] != "draft_model":  # (early layers are poor drafts: few given)
            assert stats.acceptance_rate > 0.3, (method, stats)
        assert (
            spec.llm_engine.scheduler.kv_cache.num_free_blocks
            == spec.llm_engine.executor.num_blocks
        )


def test_the_server_takes_a_speculative_config_as_json() -> None:
    import argparse

    from pyengine.entrypoints.openai.cli_args import add_server_arguments, engine_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="m")  # (as main() and `pyengine serve` add it)
    add_server_arguments(parser)
    ns = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert engine_args(ns).speculative_config == NGRAM
    assert engine_args(parser.parse_args([])).speculative_config is None
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--speculative-config", bad])


def test_lora_adapters_beside_speculation(tiny: Path, tmp_path: Path) -> None:
    """With adapters on, the LM head's adapter slots take every logits row of a step that
    verifies drafts (more rows than requests): the same tokens as without speculation."""
    from helpers.lora import write_random_adapter

    from pyengine import LoRARequest
    from pyengine.loader.resolve import load_model

    write_random_adapter(load_model(str(tiny)).config, tmp_path / "adapter", seed=3)
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    prompts = repeating_prompts(4, seed=2)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine = {"enable_lora": True, "max_num_seqs": 4}
    outputs = {}
    for name, extra in (("plain", {}), ("spec", {"speculative_config": NGRAM})):
        llm = LLM(str(tiny), max_model_len=256, kv_cache_memory=2**22, **engine, **extra)  # type: ignore[arg-type]
        outputs[name] = tokens(llm.generate(prompts, params, use_tqdm=False, lora_request=lora))
    assert outputs["spec"] == outputs["plain"]
