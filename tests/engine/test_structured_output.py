"""Structured outputs offline (SamplingParams.structured_outputs) on the default model:
JSON schemas of every kind each answer parses as and validates against (jsonschema),
greedy and sampled; regexes and choices that always hold; a grammar; constrained rows
beside free ones unchanged; preemption; bad constraints refused naming the field."""

from __future__ import annotations

import json
import re

import pytest
from helpers.schemas import SCHEMAS
from helpers.smollm2 import default_llm

from pyengine import LLM, SamplingParams, StructuredOutputsParams
from pyengine.spec_decode.config import SpeculativeConfig

jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> LLM:
    # (float32, the exact mode: an open JSON object closes within the tokens asked for
    # along the greedy path these expectations were written against)
    return default_llm(max_model_len=1024, max_num_seqs=16, dtype="float32")  # type: ignore[no-any-return]


def ask(llm: LLM, text: str, params: list[SamplingParams]) -> list:  # type: ignore[type-arg]
    messages = [[{"role": "user", "content": text}]] * len(params)
    return [o.outputs[0] for o in llm.chat(messages, params, use_tqdm=False)]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_every_answer_validates_against_its_schema(llm: LLM, temperature: float) -> None:
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=200,
                       structured_outputs=StructuredOutputsParams(json=schema))
        for i, schema in enumerate(SCHEMAS)
    ]  # fmt: skip
    outputs = ask(llm, "Answer with a JSON value that fits the task.", params)
    for schema, out in zip(SCHEMAS, outputs, strict=True):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_regexes_choices_json_objects_and_grammars_hold(llm: LLM) -> None:
    constraints = [
        (StructuredOutputsParams(regex=r"\d{3}-\d{4}"), lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
        (StructuredOutputsParams(regex=r"(yes|no), because [a-z ]{1,20}\."),
         lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", t)),
        (StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
         lambda t: t in ("positive", "negative", "neutral")),
        (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (StructuredOutputsParams(grammar='root ::= "(" [0-9] [0-9]? " + " [0-9] [0-9]? ")"'),
         lambda t: re.fullmatch(r"\(\d{1,2} \+ \d{1,2}\)", t)),
    ]  # fmt: skip
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=3, max_tokens=120,
                                 structured_outputs=c) for c, _ in constraints]  # fmt: skip
        for (constraint, holds), out in zip(constraints, ask(llm, "Go.", params), strict=True):
            assert out.finish_reason == "stop" and holds(out.text), (constraint, out.text)


def test_free_rows_beside_constrained_ones_are_unchanged(llm: LLM) -> None:
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = ask(llm, "Name a fruit.", [free])[0].token_ids
    constrained = StructuredOutputsParams(json=SCHEMAS[0])
    mixed = [free, SamplingParams(temperature=0, max_tokens=24, structured_outputs=constrained)]
    assert ask(llm, "Name a fruit.", mixed)[0].token_ids == alone


def test_a_preempted_constrained_request_still_validates() -> None:
    block = 30 * 2 * 3 * 64 * 16 * 4  # SmolLM2's K and V of 16 tokens, float32
    tight = LLM(max_model_len=128, kv_cache_memory=9 * block, max_num_seqs=8)  # 144 tokens
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=80,
                             structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % 4]))
              for i in range(8)]  # fmt: skip
    # 15 tokens each, a block's but one: every answer needs a second block, and 8 blocks
    # are all the others take
    prompts = [{"prompt_token_ids": list(range(100 + 15 * i, 115 + 15 * i))} for i in range(8)]
    outputs = [o.outputs[0] for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.llm_engine.scheduler.stats().num_preemptions > 0
    for p, out in zip(params, outputs, strict=True):
        assert p.structured_outputs is not None and isinstance(p.structured_outputs.json, dict)
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), p.structured_outputs.json)
    assert (
        tight.llm_engine.scheduler.kv_cache.num_free_blocks == tight.llm_engine.executor.num_blocks
    )


SPECULATION = {
    "ngram": ({"method": "ngram", "num_speculative_tokens": 4}, {}),
    "suffix": ({"method": "suffix", "num_speculative_tokens": 4}, {}),
    # (the first 4 layers: drafts within the grammar, a few right)
    "draft_layers": ({"method": "draft_model", "draft_layers": 4, "num_speculative_tokens": 3},
                     {}),
    # (a worker process: every row masked before its draw, in the core)
    "ngram, worker process": ({"method": "ngram", "num_speculative_tokens": 4},
                              {"distributed_executor_backend": "mp"}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(SPECULATION))
def test_constrained_requests_speculate_with_the_tokens_of_no_speculation(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A constrained row after drafts is checked or masked from the matcher after them,
    taken back after: greedy, the same tokens as without speculation, and seeded rows
    (temperature alone, and with top-p) too where rows are masked alike; drafts
    accepted; each answer validates (its JSON repeats itself, so prompt lookup has
    something to propose; a draft model's drafts come in the step itself)."""
    schema = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 12}
    constrained = StructuredOutputsParams(json=schema)
    pairs = StructuredOutputsParams(regex=r"(ab|cd){1,15}")
    params = [SamplingParams(temperature=0, max_tokens=80, structured_outputs=constrained),
              SamplingParams(temperature=0, max_tokens=40, structured_outputs=pairs),
              SamplingParams(temperature=0.7, seed=5, max_tokens=60,
                             structured_outputs=constrained),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=60,
                             structured_outputs=constrained)]  # fmt: skip
    speculative_config, executor = SPECULATION[case]
    # Drafts free: every step drafts (the budget would stop a poor draft model's soon).
    monkeypatch.setattr(SpeculativeConfig, "draft_row_cost", staticmethod(lambda *_: 0.0))
    plain = default_llm(max_model_len=512)
    spec = default_llm(max_model_len=512, speculative_config=speculative_config, **executor)
    try:
        want = ask(plain, "Colors, as a JSON list.", params)
        got = ask(spec, "Colors, as a JSON list.", params)
    finally:
        spec.llm_engine.shutdown()
    # (rows are checked or masked alike in this process and in a worker process: seeded
    # rows take the same numbers under every executor)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.llm_engine.core.spec_stats.num_accepted_tokens > 0
    for out in (got[0], got[2], got[3]):
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
    assert re.fullmatch(r"(ab|cd){1,15}", got[1].text)


@pytest.mark.parametrize(
    ("constraint", "message"),
    [(lambda: StructuredOutputsParams(json={"type": "objectx"}), "structured_outputs.json"),
     (lambda: StructuredOutputsParams(regex="[a-"), "structured_outputs.regex"),
     (lambda: StructuredOutputsParams(grammar="root ::= ("), "structured_outputs.grammar"),
     (lambda: StructuredOutputsParams(json="{not json"), "structured_outputs.json"),
     (lambda: StructuredOutputsParams(regex="a", choice=["b"]), "exactly one"),
     (lambda: StructuredOutputsParams(), "exactly one"),
     (lambda: StructuredOutputsParams(choice=[]), "non-empty list of strings")],
)  # fmt: skip
def test_bad_constraints_are_refused_naming_the_field(llm: LLM, constraint, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        llm.generate(["x"], SamplingParams(structured_outputs=constraint()), use_tqdm=False)
    assert not llm.llm_engine.requests  # nothing entered the engine
