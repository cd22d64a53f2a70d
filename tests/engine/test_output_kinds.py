"""What the engine's steps hand out, by SamplingParams.output_kind: deltas that add up to
the whole answer (text that could begin a stop string held back, never taken back), whole
copies at every step, or one whole output at the end."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from helpers.smollm2 import default_llm

from pyengine import LLM, SamplingParams
from pyengine.engine.detokenizer import GrowingText
from pyengine.outputs import CompletionOutput, RequestOutput
from pyengine.sampling_params import RequestOutputKind

PROMPT = "The future of AI is"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return default_llm(max_model_len=512)  # type: ignore[no-any-return]


def run(llm: LLM, request_id: str, params: SamplingParams) -> list[RequestOutput]:
    """Every output the engine's steps hand out for one request, alone in the engine."""
    engine = llm.llm_engine
    engine.add_request(request_id, llm.get_tokenizer().encode(PROMPT), params)
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.request_id == request_id]
    return outputs


def joined(deltas: list[RequestOutput], n: int) -> list[CompletionOutput]:
    """Each sample's deltas added up."""
    whole = [CompletionOutput(k, "", []) for k in range(n)]
    for delta in deltas:
        for o in delta.outputs:
            w = whole[o.index]
            w.text += o.text
            w.token_ids += o.token_ids
            if o.logprobs is not None:
                w.logprobs = (w.logprobs or []) + o.logprobs
            w.finish_reason, w.stop_reason = o.finish_reason, o.stop_reason
            w.cumulative_logprob = o.cumulative_logprob
    return whole


def stop_string_inside(llm: LLM) -> str:
    """A stop string from the middle of the greedy answer (it spans several tokens)."""
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    text = llm.generate(PROMPT, free, use_tqdm=False)[0].outputs[0].text
    assert len(text) > 30, "the greedy text is too short for this test"
    return text[20:26]


@pytest.mark.parametrize("include", [False, True])
def test_deltas_add_up_to_the_whole_output_of_each_kind(llm: LLM, include: bool) -> None:
    stop = stop_string_inside(llm)
    params = SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=24, logprobs=2,
                            prompt_logprobs=1, stop=[stop, "\n\n"],
                            include_stop_str_in_output=include)  # fmt: skip
    kinds = {kind: replace(params, output_kind=kind) for kind in RequestOutputKind}
    cumulative = run(llm, "cumulative", kinds[RequestOutputKind.CUMULATIVE])
    deltas = run(llm, "delta", kinds[RequestOutputKind.DELTA])
    final = run(llm, "final", kinds[RequestOutputKind.FINAL_ONLY])
    assert len(final) == 1 and final[0].finished
    whole = final[0].outputs
    assert cumulative[-1].outputs == whole and cumulative[-1].finished
    assert joined(deltas, 2) == whole
    assert len(deltas) > 1 and deltas[-1].finished and not deltas[0].finished
    # The prompt's logprobs come once with deltas, in the first; whole outputs all hold them.
    assert deltas[0].prompt_logprobs is not None
    assert deltas[0].prompt_logprobs == final[0].prompt_logprobs == cumulative[0].prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    # No delta's text is taken back: what has come so far begins the final text.
    for k in range(2):
        so_far = ""
        for delta in deltas:
            so_far += "".join(o.text for o in delta.outputs if o.index == k)
            assert whole[k].text.startswith(so_far)
    # Each sample finishes once, and nothing comes for it after.
    for k in range(2):
        reasons = [o.finish_reason for d in deltas for o in d.outputs if o.index == k]
        assert reasons[-1] is not None and all(r is None for r in reasons[:-1])


def test_a_delta_holds_back_text_that_could_begin_a_stop_string(llm: LLM) -> None:
    """With a stop string that never comes, the text that could begin one is held back
    until later text rules it out, and the last delta brings all of the rest."""
    stop = "\u2603" * 5  # five snowmen: never generated, so held back are 4 characters
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stop,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    deltas = run(llm, "held", params)
    text = joined(deltas, 1)[0].text
    so_far = ""
    for delta in deltas[:-1]:
        so_far += "".join(o.text for o in delta.outputs)
        assert len(so_far) <= len(text) - 4
    assert deltas[-1].outputs[0].finish_reason == "length"
    free = replace(params, stop=None, output_kind=RequestOutputKind.FINAL_ONLY)
    assert text == run(llm, "free", free)[0].outputs[0].text


def test_cumulative_outputs_are_copies_and_final_only_waits_for_the_end(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    cumulative = run(llm, "copies", params)  # CUMULATIVE: the default
    assert [len(o.outputs[0].token_ids) for o in cumulative] == [1, 2, 3, 4, 5]
    assert all(o.outputs[0].text for o in cumulative)
    final = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    (only,) = run(llm, "once", final)
    assert only.outputs[0].token_ids == cumulative[-1].outputs[0].token_ids
    assert only.metrics.finish_reasons == ["length"] and only.metrics.num_output_tokens == [5]


def test_output_kind_is_checked() -> None:
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")  # type: ignore[arg-type]


def test_growing_text_reads_and_cuts_as_a_string_would() -> None:
    """GrowingText against a plain string, over random appends, cuts and reads."""
    rng = random.Random(0)
    for _ in range(300):
        text, reference = GrowingText(), ""
        for _ in range(rng.randint(1, 30)):
            action = rng.random()
            if action < 0.6:
                piece = "".join(rng.choice("ab\u00e9") for _ in range(rng.randint(0, 5)))
                text.append(piece)
                reference += piece
            elif action < 0.8:
                end = rng.randint(0, len(reference))
                text.cut(end)
                reference = reference[:end]
            else:
                assert text.whole() == reference
            start = rng.randint(0, len(reference) + 2)
            assert text.since(start) == reference[start:]
            assert text.length == len(reference)
