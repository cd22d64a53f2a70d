"""use_beam_search on the completions endpoint (vLLM's), through the official openai
client against the server run as a user runs it with the default model: each prompt's
n best beams are the offline LLM.beam_search's, best first, whole or streamed (at the
end, a chunk each); what a beam search cannot take (logprobs, echo) is a 400 naming it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from helpers.server import Server, openai_client, serving
from helpers.smollm2 import default_llm

from pyengine import BeamSearchParams
from pyengine.loader.resolve import DEFAULT_MODEL

PROMPTS = ["The capital of France is", "Paged attention stores"]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serving()


def test_the_servers_beams_are_the_offline_ones(server: Server) -> None:
    beams = dict(use_beam_search=True, length_penalty=0.5)
    answer = openai_client(server).completions.create(
        model=DEFAULT_MODEL, prompt=PROMPTS, n=3, max_tokens=6, extra_body=beams
    )
    llm = default_llm()
    offline = llm.beam_search(
        PROMPTS, BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5)
    )
    texts = [c.text for c in sorted(answer.choices, key=lambda c: c.index)]
    assert texts == [beam.text for output in offline for beam in output.sequences]
    assert len(set(texts[:3])) == 3


def test_streamed_beams_come_at_the_end(server: Server) -> None:
    ask = dict(model=DEFAULT_MODEL, prompt=PROMPTS, n=2, max_tokens=5,
               extra_body={"use_beam_search": True})  # fmt: skip
    whole = openai_client(server).completions.create(**ask)  # type: ignore[call-overload]
    chunks = list(openai_client(server).completions.create(
        **ask, stream=True, stream_options={"include_usage": True}))  # fmt: skip
    choices = [(c.choices[0].index, c.choices[0].text) for c in chunks if c.choices]
    assert choices == [(c.index, c.text) for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("field", [{"echo": True}, {"logprobs": 2}])
def test_what_a_beam_search_cannot_take_is_named(server: Server, field: dict[str, object]) -> None:
    with pytest.raises(openai.BadRequestError, match=next(iter(field))):
        openai_client(server).completions.create(
            model=DEFAULT_MODEL, prompt=PROMPTS[0], n=2, max_tokens=4,
            extra_body={"use_beam_search": True}, **field,  # type: ignore[arg-type]
        )  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value"), [("n", 0), ("length_penalty", float("nan")), ("priority", 1)]
)
def test_a_bad_beam_parameter_is_named(server: Server, field: str, value: float) -> None:
    """(streamed too: the first step is queued before the stream begins)"""
    body = {"model": DEFAULT_MODEL, "prompt": PROMPTS[0], "n": 2, "max_tokens": 4,
            "use_beam_search": True, "stream": True, field: value}  # fmt: skip
    status, answer = server.request("POST", "/v1/completions", json.dumps(body))
    assert status == 400, answer
    assert answer["error"]["param"] == field
    assert answer["error"]["message"].startswith(field)
