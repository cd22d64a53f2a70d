"""A thinking model's reasoning in the engine (SamplingParams.thinking_end_token_ids), on
the default model with a stand-in end of thinking: a structured output constrains only
the answer after the end (the reasoning is the free greedy path), and max_thinking_tokens
forces the end once that many tokens of reasoning are written, the answer following."""

from __future__ import annotations

import re

import pytest
from helpers.smollm2 import default_llm

from pyengine import LLM, SamplingParams, StructuredOutputsParams

ANSWER = r"(yes|no), because [a-z ]{1,20}\."
PROMPT = "Think about it, then answer: is the sky blue?"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return default_llm(max_model_len=512, dtype="float32")  # type: ignore[no-any-return]


def run(llm: LLM, **params: object) -> list[int]:
    sampling = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **params)  # type: ignore[arg-type]
    out = llm.chat([{"role": "user", "content": PROMPT}], sampling, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def test_a_structured_output_constrains_the_answer_after_the_thinking(llm: LLM) -> None:
    free = run(llm)
    end = [free[5]]  # (the model's own sixth token ends its "reasoning")
    constrained = StructuredOutputsParams(regex=ANSWER)
    tokens = run(llm, thinking_end_token_ids=end, structured_outputs=constrained)
    at = free.index(end[0]) + 1
    assert tokens[:at] == free[:at]  # the reasoning: the free greedy path, unconstrained
    answer = llm.get_tokenizer().decode(tokens[at:])
    assert re.fullmatch(ANSWER, answer), answer
    # Without the thinking's end, the grammar constrains from the first token.
    whole = run(llm, structured_outputs=constrained)
    assert re.fullmatch(ANSWER, llm.get_tokenizer().decode(whole))


@pytest.mark.parametrize("budget", [0, 4])
def test_a_thinking_budget_forces_the_end(llm: LLM, budget: int) -> None:
    free = run(llm)
    tokenizer = llm.get_tokenizer()
    end = tokenizer.encode(" Final answer:", add_special_tokens=False)
    assert len(end) > 1 and not set(end) & set(free[: budget + 1])
    tokens = run(llm, thinking_end_token_ids=end, max_thinking_tokens=budget)
    assert tokens[:budget] == free[:budget]  # reasoning as free, up to the budget
    assert tokens[budget : budget + len(end)] == end  # then the end, forced
    # ... and with a structured output, the answer after it holds to the grammar.
    constrained = StructuredOutputsParams(regex=ANSWER)
    tokens = run(llm, thinking_end_token_ids=end, max_thinking_tokens=budget,
                 structured_outputs=constrained)  # fmt: skip
    assert tokens[budget : budget + len(end)] == end
    assert re.fullmatch(ANSWER, tokenizer.decode(tokens[budget + len(end) :]))


def test_a_budget_needs_the_end_it_forces() -> None:
    with pytest.raises(ValueError, match="max_thinking_tokens must be an integer >= 0 with"):
        SamplingParams(max_thinking_tokens=4)


def test_a_thinking_row_does_not_speculate(llm: LLM) -> None:
    """Under speculative decoding the budget and the grammar's waking still hold: a
    thinking row takes no drafts (its tokens those of no speculation)."""
    end = llm.get_tokenizer().encode(" Final answer:", add_special_tokens=False)
    fields = dict(thinking_end_token_ids=end, max_thinking_tokens=4,
                  structured_outputs=StructuredOutputsParams(regex=ANSWER))  # fmt: skip
    drafted = default_llm(
        max_model_len=512, dtype="float32",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )  # fmt: skip
    assert run(drafted, **fields) == run(llm, **fields)
