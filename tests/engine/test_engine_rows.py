"""The engine's per-row bookkeeping: a step skips building sampling rows, prompt-logprob
rows and first-step notes where no request needs them, and switches a greedy request to
the plain argmax once it is past min_tokens. Each case checks the tokens against the
same request run alone, and that nothing is left behind."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers.tiny_models import TINY_LLAMA

from pyengine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder: Path = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return LLM(str(folder), load_format="dummy", dtype="float32", max_model_len=256)


def tokens(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def assert_nothing_left(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.requests and not engine.output_processor.by_row_id
    core = engine.core
    assert not core._rows and not core._live_rows
    assert not core._unscheduled and not core._prompt_logprobs
    assert not core._sampled_rows


def test_min_tokens_blocks_a_stop_token_then_greedy_resumes(llm: LLM) -> None:
    prompt = np.random.default_rng(0).integers(0, 512, 9).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    free = tokens(llm, [prompt], [greedy])[0]
    # A token greedy picks at step k and not before: stopping on it is blocked to k + 2.
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    held = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[free[k]], min_tokens=k + 2
    )
    alone = tokens(llm, [prompt], [held])[0]
    assert alone[:k] == free[:k] and alone[k] != free[k]
    assert free[k] not in alone[: k + 2] and len(alone) >= k + 2
    # Among plain greedy requests, with n = 2: the same tokens, and theirs unchanged.
    other = np.random.default_rng(1).integers(0, 512, 20).tolist()
    batch = tokens(llm, [other, prompt, other], [greedy, held, greedy])
    assert batch[1] == alone
    assert batch[0] == batch[2] == tokens(llm, [other], [greedy])[0]
    assert_nothing_left(llm)


def test_prompt_logprobs_and_sampled_rows_in_a_greedy_batch(llm: LLM) -> None:
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 512, n).tolist() for n in (5, 30, 12)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(prompts, [greedy, scored, seeded], use_tqdm=False)
    assert outputs[0].prompt_logprobs is None
    scores = outputs[1].prompt_logprobs
    assert scores is not None and scores[0] is None and len(scores) == 30
    assert all(entry is not None and prompts[1][i] in entry for i, entry in enumerate(scores) if i)
    assert outputs[1].outputs[0].token_ids == tokens(llm, [prompts[1]], [greedy])[0]
    assert outputs[2].outputs[0].token_ids == tokens(llm, [prompts[2]], [seeded])[0]
    assert_nothing_left(llm)


def test_prompt_logprobs_come_the_same_a_few_rows_at_a_time(
    llm: LLM, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A 60-token prompt's logprobs are taken max_num_seqs rows at a time: in 15 slices
    under max_num_seqs=4, as in one under the default 256 (same dummy weights)."""
    folder: Path = tmp_path_factory.mktemp("tiny-narrow")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    narrow = LLM(str(folder), load_format="dummy", dtype="float32", max_model_len=256,
                 max_num_seqs=4)  # fmt: skip
    prompt = np.random.default_rng(4).integers(0, 512, 60).tolist()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=5)
    wide_out, narrow_out = (m.generate([prompt], params, use_tqdm=False)[0] for m in (llm, narrow))
    assert wide_out.outputs[0].token_ids == narrow_out.outputs[0].token_ids
    wide, slices = wide_out.prompt_logprobs, narrow_out.prompt_logprobs
    assert wide is not None and slices is not None and len(wide) == len(slices) == 60
    for position, (a, b) in enumerate(zip(wide[1:], slices[1:], strict=True), start=1):
        assert a is not None and b is not None and a.keys() == b.keys()
        assert prompt[position] in a and 5 <= len(a) <= 6
        for token in a:
            assert a[token].rank == b[token].rank
            assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-5)
    assert_nothing_left(narrow)


def changed_after_made() -> SamplingParams:
    params = SamplingParams(max_tokens=4, temperature=0.5)
    params.logprobs = -1  # past the checks made at construction
    return params


def test_params_changed_while_a_request_runs_do_not_touch_it(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = tokens(llm, [[1, 2, 3]], [params])[0]
    llm.llm_engine.add_request("changing", [1, 2, 3], params)
    llm.llm_engine.step()
    params.max_tokens, params.logprobs = 1, -1  # the engine runs its own copy
    got = []
    while llm.llm_engine.has_unfinished_requests():
        got += [o.outputs[0].token_ids for o in llm.llm_engine.step() if o.finished]
    assert got == [want]
    assert_nothing_left(llm)


def test_bad_token_ids_and_too_many_logprobs_are_refused(llm: LLM) -> None:
    """Refused when added, naming the problem; the requests beside them are not lost."""
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = tokens(llm, [[1, 2, 3]], [greedy])[0]
    for bad, params, match in [
        ([1, 2.7, 3], greedy, "integers"),
        ([1, "2", 3], greedy, "integers"),
        ([1, 2, 512], greedy, "outside the vocabulary"),
        ([1, 2, 3], SamplingParams(max_tokens=4, logprobs=21), "logprobs 21 is more than"),
        ([1, 2, 3], SamplingParams(max_tokens=4, prompt_logprobs=10**6), "max_logprobs"),
        ([1, 2, 3], SamplingParams(max_tokens=4, n=2**40), "n 1099511627776 is more than max_"),
        ([1, 2, 3], SamplingParams(max_tokens=4, stop_token_ids=[2**40]), "stop_token_ids"),
        ([1, 2, 3], changed_after_made(), "logprobs must be"),
        ([1, 2, 3], SamplingParams(max_tokens=4, logit_bias={512: 5.0}), "logit_bias: token id"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.generate([[1, 2, 3], {"prompt_token_ids": bad}], [greedy, params], use_tqdm=False)
        assert_nothing_left(llm)
        assert llm.llm_engine.scheduler.kv_cache.stats().num_used_blocks == 0
    assert tokens(llm, [[1, 2, 3]], [greedy])[0] == want
    with pytest.raises(ValueError, match="request id must be a string"):
        llm.llm_engine.add_request(7, [1, 2], greedy)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is not a SamplingParams"):
        llm.llm_engine.add_request("x", [1, 2], {"max_tokens": 3})  # type: ignore[arg-type]
    assert_nothing_left(llm)
    top = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=20)
    entries = llm.generate([[1, 2, 3]], top, use_tqdm=False)[0].outputs[0].logprobs
    assert entries is not None and all(len(entry) == 20 for entry in entries)


def test_aborted_requests_leave_no_row_behind(llm: LLM) -> None:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=2, prompt_logprobs=0)
    engine.add_request("never-scheduled", [1, 2, 3], params)
    engine.add_request("mid-way", [4, 5, 6], params)
    engine.abort_request("never-scheduled")
    engine.step()
    engine.abort_request("mid-way")
    engine.discard_finished()
    assert_nothing_left(llm)
