"""Sampling on the default model: seeds, top-k, penalties, parallel samples, stop strings,
logprobs, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.chi_square import chi_square, chi_square_bound
from helpers.hf_reference import prefill_logits
from helpers.smollm2 import default_llm

from pyengine import LLM, SamplingParams
from pyengine.sample.common import row_argmax, seeded_uniform
from pyengine.sample.logits_processors import apply_penalties, mask_disallowed_tokens
from pyengine.sample.logprobs import gather_logprobs
from pyengine.sample.sampler import Sampler, heaviest_rows, plain_greedy
from pyengine.sample.token_selection import filter_logits
from pyengine.step_values import SamplingRow

PROMPTS = [
    "The future of AI is",
    "How does PagedAttention work?",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Once upon a time",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return default_llm(max_model_len=1024)  # type: ignore[no-any-return]


def tokens_of(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
def test_seeded_request_is_the_same_alone_and_in_a_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=7)
    alone = tokens_of(llm, [PROMPTS[0]], [seeded])[0]
    others = [SamplingParams(temperature=1.0, max_tokens=16 + i) for i in range(4)]
    batch = tokens_of(llm, PROMPTS, [others[0], seeded, *others[1:]])
    # The seeded prompt sits at another place in the batch, next to unseeded ones.
    assert tokens_of(llm, [PROMPTS[1], PROMPTS[0]], [others[0], seeded])[1] == alone
    assert batch[1] != alone or PROMPTS[1] == PROMPTS[0]  # a different prompt, not a copy
    assert tokens_of(llm, [PROMPTS[0]], [seeded])[0] == alone


@pytest.mark.slow
def test_top_k_one_is_greedy(llm: LLM) -> None:
    greedy = tokens_of(llm, PROMPTS, [SamplingParams(temperature=0, max_tokens=16)] * 5)
    top1 = tokens_of(llm, PROMPTS, [SamplingParams(temperature=1.3, top_k=1, max_tokens=16)] * 5)
    assert top1 == greedy
    # A temperature too small to divide by is greedy too (vLLM's 1e-5), with any filter.
    tiny = [SamplingParams(temperature=t, top_p=0.5, max_tokens=16) for t in (1e-30, 1e-6)]
    assert tokens_of(llm, PROMPTS[:2], tiny) == greedy[:2]
    assert not SamplingParams(temperature=1e-5).greedy


def reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], p: SamplingParams
) -> list[float]:
    result = list(logits)
    for token in set(prompt) | set(output):
        value = result[token]
        result[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token in set(output):
        result[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return result


def test_penalties_match_the_reference() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(50, generator=generator) * 3
    prompt, output = [1, 4, 4, 9, 30], [4, 7, 7, 7, 12, 49]
    p = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.7)
    plain = SamplingParams()
    batch = torch.stack([logits, logits, logits])  # the penalized row between two plain ones
    apply_penalties(batch, [SamplingRow(plain, prompt, output, None),
                            SamplingRow(p, prompt, output, None),
                            SamplingRow(plain, prompt, output, None)])  # fmt: skip
    expected = reference_penalties(logits.tolist(), prompt, output, p)
    assert torch.allclose(batch[1], torch.tensor(expected), atol=1e-6)
    assert torch.equal(batch[0], logits) and torch.equal(batch[2], logits)


def test_a_penalty_far_from_one_keeps_the_logits_finite() -> None:
    """Dividing by a tiny repetition penalty overflows float32; the row must still give
    a token (the largest logits: the prompt's, pushed up), not NaN."""
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(4))
    logits[:, [3, 5]] = torch.tensor([2.0, 1.0])
    rows = [SamplingRow(SamplingParams(temperature=t, repetition_penalty=1e-39), [3, 5], [], None)
            for t in (0.0, 0.8)]  # fmt: skip
    penalized = logits.clone()
    apply_penalties(penalized, rows)
    assert torch.isfinite(penalized).all()
    assert set(Sampler(0)(logits, rows).token_ids) <= {3, 5}


def test_penalties_of_many_rows_match_the_reference() -> None:
    """Rows of different penalties, repeated tokens and lengths (an empty output too) in
    one batch, each as the reference has it alone."""
    rng = np.random.default_rng(8)
    vocab, rows = 40, []
    for i in range(12):
        params = SamplingParams(
            repetition_penalty=[1.0, 1.2, 0.8][i % 3],
            frequency_penalty=[0.0, 0.5, -0.3, 1.1][i % 4],
            presence_penalty=[0.0, 0.7][i % 2],
        )
        prompt = rng.integers(0, vocab, rng.integers(1, 30)).tolist()
        output = rng.integers(0, vocab, i * 3).tolist()
        rows.append(SamplingRow(params, prompt, output, None))
    logits = torch.from_numpy(rng.standard_normal((12, vocab)) * 3).float()
    batch = logits.clone()
    apply_penalties(batch, rows)
    for got, x, r in zip(batch, logits, rows, strict=True):
        want = reference_penalties(x.tolist(), r.prompt_token_ids, r.output_token_ids, r.params)
        assert torch.allclose(got, torch.tensor(want), atol=1e-5)


def test_top_p_top_k_min_p_keep_the_right_tokens() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    cases = [  # (top_k, top_p, min_p) -> kept; the rows of one batch, each token order shuffled
        ((2, 1.0, 0.0), [0, 1]),
        ((0, 0.7, 0.0), [0, 1]),  # 0.5 < 0.7 <= 0.75
        ((0, 0.8, 0.0), [0, 1, 2]),
        ((0, 1.0, 0.2), [0, 1, 2]),  # >= 0.1
        ((0, 1.0, 0.0), [0, 1, 2, 3, 4]),
        ((3, 0.6, 0.0), [0, 1]),
        ((1, 1.0, 0.0), [0]),
    ]
    orders = [torch.randperm(5) for _ in cases]
    logits = torch.stack([torch.log(probs[order]) for order in orders])
    filtered = filter_logits(
        logits,
        [k for (k, _, _), _ in cases],
        [p for (_, p, _), _ in cases],
        [m for (_, _, m), _ in cases],
    )
    for row, order, (_, want) in zip(filtered, orders, cases, strict=True):
        kept = order[torch.isfinite(row)].sort().values.tolist()
        assert kept == want
    # A batch without top-p takes another path (the k largest, no sort): the same tokens.
    no_p = [i for i, ((_, p, _), _) in enumerate(cases) if p == 1.0]
    alone = filter_logits(
        logits[no_p],
        [cases[i][0][0] for i in no_p],
        [1.0] * len(no_p),
        [cases[i][0][2] for i in no_p],
    )
    assert torch.equal(alone, filtered[no_p])


def test_n_samples_are_distinct_and_share_one_prefill(llm: LLM) -> None:
    engine = llm.llm_engine
    prompt = llm.get_tokenizer().encode(PROMPTS[2] * 3)
    engine.add_request(
        "n4", prompt, SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=1, ignore_eos=True)
    )
    computed, outputs = 0, []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.finished]
        computed += engine.scheduler.buffers.num_tokens
    (out,) = outputs
    samples = [o.token_ids for o in out.outputs]
    assert len(samples) == 4 and len({tuple(s) for s in samples}) == 4
    assert all(len(s) == 10 for s in samples)
    # One prefill of the prompt, then one token per sample per step.
    assert computed == len(prompt) + 4 * (10 - 1)
    assert engine.scheduler.kv_cache.stats().num_used_blocks == 0


@pytest.mark.slow
def test_stop_strings_are_cut_across_token_boundaries(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    ids = free[0].outputs[0].token_ids
    text = free[0].outputs[0].text
    # A stop string from the middle of one token to the middle of a later one.
    first = len(tokenizer.decode(ids[:6]))
    second = len(tokenizer.decode(ids[:8]))
    start, end = first - 1, second - 1
    assert 0 < start < end, "the greedy text is too short for this test"
    stop = text[start:end]
    assert text.find(stop) == start
    for include in (False, True):
        params = SamplingParams(
            temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=include
        )
        out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
        assert out.text == (text[:end] if include else text[:start])
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert len(out.token_ids) <= 8


def test_stop_strings_are_found_in_tokens_of_many_characters(llm: LLM) -> None:
    """SmolLM2's token 45855 is 80 '#': a stop string anywhere in a token's text counts,
    however long the text."""
    wide = 45855
    assert llm.get_tokenizer().decode([wide], False) == "#" * 80
    prompt = {"prompt_token_ids": [wide, 198] * 6}  # it repeats: '#' * 80, '\n', ...
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert free[0].outputs[0].token_ids[:3] == [wide, 198, wide]
    for stop, text in (("#", ""), ("\n#", "#" * 80), ("#\n##", "#" * 79)):
        params = SamplingParams(temperature=0, max_tokens=6, stop=[stop])
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert (out.text, out.finish_reason, out.stop_reason) == (text, "stop", stop)


def test_logprobs_are_log_softmax_of_the_model_logits(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    out = llm.generate(PROMPTS[3], params, use_tqdm=False)[0]
    sequence = out.prompt_token_ids + out.outputs[0].token_ids
    reference = torch.log_softmax(prefill_logits(llm, sequence), dim=-1)
    n = len(out.prompt_token_ids)
    generated = out.outputs[0]
    assert generated.logprobs is not None and len(generated.logprobs) == 6
    for j, (token, entry) in enumerate(zip(generated.token_ids, generated.logprobs, strict=True)):
        row = reference[n - 1 + j]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == 1  # greedy
        top3 = set(torch.topk(row, 3).indices.tolist())
        assert top3 <= set(entry)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == n
    for i in range(1, n):
        entry = out.prompt_logprobs[i]
        assert entry is not None
        token = out.prompt_token_ids[i]
        assert abs(entry[token].logprob - reference[i - 1, token].item()) < 1e-4


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1.0), ("top_p", 0.0), ("top_k", -3), ("n", 0), ("max_tokens", 0),
     ("min_p", 1.5), ("repetition_penalty", 0.0), ("stop", [""]), ("logprobs", -1),
     ("presence_penalty", 3.0), ("seed", 1.5), ("stop_token_ids", [-1]),
     ("temperature", float("inf")), ("repetition_penalty", float("inf")), ("top_p", float("nan")),
     ("ignore_eos", "no"), ("skip_special_tokens", 1), ("stop", 5), ("stop", ["a", 3]),
     ("stop", ""), ("stop_token_ids", 5), ("logprobs", True), ("logit_bias", {5: 101}),
     ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}), ("logit_bias", [5])],
)  # fmt: skip
def test_invalid_sampling_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


@pytest.mark.slow
def test_bad_prompts_are_refused_and_the_engine_keeps_serving(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([PROMPTS[0], {"prompt_token_ids": []}], params, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([PROMPTS[0], [1, 2, 10**9]], params, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 2000], params, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([3.5], params, use_tqdm=False)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="'prompt' \\(a string\\)"):
        llm.generate([{"prompt": None}], params, use_tqdm=False)  # type: ignore[list-item]
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.scheduler.kv_cache.stats().num_used_blocks == 0
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_engine_serves_on_after_an_abort_empties_a_step(llm: LLM) -> None:
    """An abort between steps leaves a step with nothing to run; the engine goes on."""
    engine = llm.llm_engine
    prompt = llm.get_tokenizer().encode(PROMPTS[0])
    engine.add_request("gone", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request("gone")
    (out,) = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    engine.add_request("next", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs[-1].outputs[0].token_ids) == 3


def sampling_rows(params: list[SamplingParams], seeds: list[int | None]) -> list[SamplingRow]:
    return [SamplingRow(p, [1, 2, 3], [4, 4], s, (7,) if p.min_tokens else ())
            for p, s in zip(params, seeds, strict=True)]  # fmt: skip


def test_seeded_draws_are_uniform_and_depend_on_the_place_alone() -> None:
    """seeded_uniform: 20,000 numbers of consecutive places and seeds fill 20 equal bins
    within a chi-square bound (19 degrees of freedom, exceeded by chance with probability
    1e-4), seeds next to each other draw apart, and a seeded row's draw is that of its
    place (its output tokens' count): the same token after any number of other draws."""
    draws = np.array([seeded_uniform(seed, i) for seed in range(100) for i in range(200)])
    assert ((draws >= 0) & (draws < 1)).all()
    counts = np.bincount((draws * 20).astype(int), minlength=20)
    expected = len(draws) / 20
    assert ((counts - expected) ** 2 / expected).sum() < 49.3
    pairs = np.array([[seeded_uniform(s, 3), seeded_uniform(s + 1, 3)] for s in range(2000)])
    assert abs(np.corrcoef(pairs.T)[0, 1]) < 0.1
    params = SamplingParams(temperature=1.0, seed=5)
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(8))
    row = SamplingRow(params, [1], [2, 3, 4], 5)
    first = Sampler(0)(logits, [row]).token_ids
    sampler = Sampler(0)
    for _ in range(3):  # (draws of other places, and of another seed, in between)
        sampler(logits, [SamplingRow(params, [1], [2], 5), SamplingRow(params, [1], [2, 3], 9)])
    assert sampler(logits, [row]).token_ids == first
    assert [seeded_uniform(5, 3)] != [seeded_uniform(5, 2)]


def test_a_batch_samples_each_row_as_it_would_alone() -> None:
    """Every kind of row in one batch: greedy with penalties, blocked tokens, temperature,
    top-k/top-p/min-p, seeded; each row picks what it picks alone."""
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5),
        SamplingParams(temperature=0.8, top_k=5, seed=1),
        SamplingParams(temperature=1.2, top_p=0.5, min_p=0.05, seed=2),
        SamplingParams(temperature=0, min_tokens=3),
        SamplingParams(temperature=0.7, frequency_penalty=1.0, seed=3),
    ]
    seeds = [None, 11, 12, None, 13]
    logits = torch.randn(len(params), 64) * 3
    logits[3, 7] = 100.0  # blocked while under min_tokens
    together = Sampler(0)(logits, sampling_rows(params, seeds)).token_ids
    alone = [
        Sampler(0)(logits[i : i + 1], sampling_rows([p], [s])).token_ids[0]
        for i, (p, s) in enumerate(zip(params, seeds, strict=True))
    ]
    assert together == alone
    assert together[3] != 7


def test_sampled_frequencies_follow_the_filtered_distribution() -> None:
    """10,000 draws of one batch row: top-p 0.85 keeps the first three of these tokens, at
    their renormalized probabilities."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    rows = sampling_rows([SamplingParams(temperature=1.0, top_p=0.85)] * 10_000, [None] * 10_000)
    drawn = Sampler(5)(torch.log(probs).expand(10_000, 5), rows).token_ids
    counts = torch.bincount(torch.tensor(drawn), minlength=5).double() / 10_000
    assert counts[3:].sum() == 0
    assert torch.allclose(counts[:3], probs[:3].double() / 0.9, atol=0.02)


def reference_filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row by the definitions: min-p, then top-k, then top-p on what is left."""
    x = logits.clone()
    if min_p > 0:
        probs = torch.softmax(x, -1)
        x[probs < min_p * probs.max()] = float("-inf")
    if 0 < top_k < x.numel():
        x[x < x.sort(descending=True).values[top_k - 1]] = float("-inf")
    if top_p < 1.0:
        ordered, order = x.sort(descending=True)
        probs = torch.softmax(ordered, -1)
        outside = probs.cumsum(-1) - probs > top_p
        outside[0] = False
        x[order[outside]] = float("-inf")
    return x


@pytest.mark.parametrize("scale", [8.0, 0.05], ids=["peaked", "flat"])
def test_filter_logits_matches_the_definitions(scale: float) -> None:
    """Peaked rows keep their nucleus among the most likely 1024 tokens; flat rows reach
    past them (the whole-sort path). Mixed with top-k-only and unfiltered rows."""
    vocab = 5000
    # Fixed logits: a cumulative mass a rounding away from top_p could go either way.
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(11)) * scale
    settings = [(0, 0.9, 0.0), (0, 0.5, 0.0), (50, 0.8, 0.0), (20, 1.0, 0.0), (0, 1.0, 0.0),
                (0, 0.95, 0.01)]  # fmt: skip
    filtered = filter_logits(
        logits,
        [k for k, _, _ in settings],
        [p for _, p, _ in settings],
        [m for _, _, m in settings],
    )
    for row, x, (k, p, m) in zip(filtered, logits, settings, strict=True):
        want = reference_filter(x, k, p, m)
        assert torch.equal(torch.isfinite(row), torch.isfinite(want))
        assert torch.equal(row[torch.isfinite(row)], x[torch.isfinite(row)])


def test_row_argmax_matches_torch_with_ties_nan_and_strides() -> None:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(9, 1000, generator=gen)
    logits[1, [5, 700]] = 50.0  # a tie: the first wins
    logits[2] = float("-inf")
    logits[3, 400] = float("nan")  # NaN counts as the largest
    logits[4, [3, 999]] = float("nan")
    logits[5] = logits[5].round()  # many ties
    for x in (logits, logits[:, ::3], logits.t().contiguous().t(), logits[:0]):
        got, want = row_argmax(x), x.argmax(dim=-1)
        assert got.dtype == want.dtype == torch.int64
        assert torch.equal(got, want)
    half = logits.to(torch.bfloat16)  # (not numpy's: through torch)
    assert torch.equal(row_argmax(half), half.argmax(dim=-1))


def test_gather_logprobs_matches_the_definitions() -> None:
    """Each row's chosen token (its logprob and its rank: one plus the tokens strictly
    more likely) and its own number k of most likely tokens (ranks 1..k, in order), among
    rows asking for none, for more than the vocabulary, and with ties."""
    vocab = 300
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(5))
    logprobs = torch.log_softmax(logits, -1)
    logprobs[3, :40] = logprobs[3, 40]  # a tie the chosen token sits in
    chosen, ks = [7, 0, 299, 12, 150], [3, 0, 1, vocab + 5, 20]
    entries = gather_logprobs(logprobs, chosen, ks)
    for row, token, k, entry in zip(logprobs, chosen, ks, entries, strict=True):
        assert entry[token].logprob == float(row[token])
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        k = min(k, vocab)
        ordered = row.sort(descending=True).values
        others = [t for t in entry if t != token]  # the chosen one may be a top one too
        assert len(others) == k or (len(others) == k - 1 and row[token] >= ordered[k - 1])
        assert sorted(entry[t].rank for t in others) == sorted(set(entry[t].rank for t in others))
        for t in others:
            assert 1 <= entry[t].rank <= k
            assert entry[t].logprob == float(row[t]) == float(ordered[entry[t].rank - 1])
        if k:
            assert set((row > ordered[k - 1]).nonzero()[:, 0].tolist()) <= set(entry)


def test_the_heaviest_rows_run_every_path_of_the_sampler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the GPU memory profile samples (model_runner): on flat logits, a nucleus
    reaching past the top 1024 (the whole-row sort), and max_logprobs tokens each."""
    sorts = []
    sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **k: sorts.append(1) or sort(*a, **k))
    logits = torch.randn(8, 3000, generator=torch.Generator().manual_seed(2)) * 0.1
    out = Sampler(0)(logits, heaviest_rows(8, 20))
    assert sorts
    assert len(out.token_ids) == 8 and all(0 <= t < 3000 for t in out.token_ids)
    assert out.logprobs is not None and all(e is not None and len(e) >= 20 for e in out.logprobs)


def test_logit_bias_moves_each_row_as_asked() -> None:
    """Added to the logits of its tokens, in any row's mix of sampling (greedy or not,
    penalized): +100 all but forces a token, -100 bans the argmax."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(6))
    top = int(logits[1].argmax())
    params = [
        SamplingParams(temperature=0, logit_bias={7: 100.0}),
        SamplingParams(temperature=0, logit_bias={top: -100.0}),
        SamplingParams(temperature=0.8, repetition_penalty=1.2, logit_bias={9: 100.0}, seed=1),
    ]
    rows = [SamplingRow(p, [1, 2], [3], None) for p in params]
    chosen = Sampler(0)(logits, rows).token_ids
    assert chosen[0] == 7 and chosen[2] == 9
    biased = logits[1].clone()
    biased[top] -= 100
    assert chosen[1] == int(biased.argmax()) != top
    assert not plain_greedy(params[0])


@pytest.mark.parametrize("vocab", [200, 224, 250])  # under, at and past the mask's tokens
def test_a_bitmask_leaves_exactly_its_allowed_tokens(vocab: int) -> None:
    """Each masked row keeps its logits where bit t % 32 of word t // 32 is set, -inf
    elsewhere and past the mask; rows without a mask are unchanged."""
    rng = np.random.default_rng(vocab)
    words = rng.integers(-(2**31), 2**31, (3, 7), dtype=np.int64).astype(np.int32)
    words[0, 1], words[2, 3] = -1, 0  # (whole words allowed and refused)
    logits = torch.randn(5, vocab)
    params = SamplingParams()
    masked_rows = {0: words[0], 2: words[1], 3: words[2]}
    rows = [SamplingRow(params, [], [], None, (), masked_rows.get(i)) for i in range(5)]
    expected = logits.double().clone()
    for i, mask in masked_rows.items():
        bits = [(int(mask[t // 32]) >> (t % 32)) & 1 if t < 224 else 0 for t in range(vocab)]
        expected[i, torch.tensor(bits) == 0] = float("-inf")
    mask_disallowed_tokens(logits, rows)
    assert torch.equal(logits.double(), expected)
    every = [SamplingRow(params, [], [], None, (), words[i % 3]) for i in range(3)]
    alone = torch.randn(3, vocab)
    want = torch.stack([alone[i : i + 1].clone() for i in range(3)])
    for i in range(3):
        mask_disallowed_tokens(want[i], every[i : i + 1])
    mask_disallowed_tokens(alone, every)  # (every row masked: in place at once)
    assert torch.equal(alone, want.squeeze(1))


class OneGrammar:
    """A step's grammar (as engine/structured_output.py's StepGrammar) that allows the
    same tokens at every row it checks; it counts the masks it makes."""

    def __init__(self, allowed: list[int], vocab: int, rows: list[int]) -> None:
        self.allowed, self.rows, self.masks_made = set(allowed), rows, 0
        bits = np.zeros(-(-vocab // 32) * 32, dtype=np.uint8)
        bits[allowed] = 1
        self.words = np.packbits(bits, bitorder="little").view(np.int32)

    def refused(self, token_ids: list[int]) -> list[int]:
        return [i for i in self.rows if token_ids[i] not in self.allowed]

    def masks(self, rows: list[int]) -> np.ndarray:
        self.masks_made += len(rows)
        return np.stack([self.words] * len(rows))


def sample_checked(
    sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], check: OneGrammar
) -> list[int]:
    """The engine's two calls: every row drawn, the checked ones without their masks;
    then the rows whose grammar refuses their token drawn again under their masks."""
    first = sampler(logits, rows, check.rows)
    tokens = list(first.token_ids)
    refused = check.refused(tokens)
    if refused:
        assert first.redraws is not None
        again = sampler.redraw(first.redraws, refused, check.masks(refused))
        for k, i in enumerate(refused):
            tokens[i] = again.token_ids[k]
    return tokens


def test_a_grammar_checked_after_the_draw_samples_the_masked_distribution() -> None:
    """Rows drawn without their mask, and drawn again under it where the grammar refuses
    the token (unseeded from the generator, seeded from their second number): the
    tokens follow the masked distribution within a chi-square bound, and only refused
    rows make masks; greedy rows get the argmax of the allowed tokens."""
    logits = torch.tensor([2.0, 0.5, 1.5, 0.0, 1.0, -0.5, 0.8, 1.8])
    allowed = [1, 4, 6, 7]
    n = 20_000
    sampled = SamplingParams(temperature=0.9)
    probs = torch.softmax(logits.double() / 0.9, dim=-1).numpy()
    masked = np.zeros_like(probs)
    masked[allowed] = probs[allowed] / probs[allowed].sum()
    for seeded in (False, True):
        rows = [SamplingRow(sampled, [], [], i if seeded else None) for i in range(n)]
        check = OneGrammar(allowed, 8, list(range(n)))
        tokens = sample_checked(Sampler(seed=0), logits.repeat(n, 1), rows, check)
        assert set(tokens) <= set(allowed)
        stat, degrees = chi_square(np.bincount(tokens, minlength=8), masked)
        assert stat < chi_square_bound(degrees), (seeded, stat)
        assert 0 < check.masks_made < n * (1 - probs[allowed].sum()) * 1.1
    greedy = [SamplingRow(SamplingParams(temperature=0), [], [], None) for _ in range(2)]
    both = torch.stack([logits, logits.flip(0)])  # argmax 0 (refused), then 7 (allowed)
    check = OneGrammar(allowed, 8, [0, 1])
    assert sample_checked(Sampler(seed=0), both, greedy, check) == [7, 7]
    assert check.masks_made == 1
