"""use_beam_search on the completions endpoint (vLLM's), through the official openai
client against the server run as a user runs it with the default model: each prompt's
n best beams are the offline LLM.beam_search's, best first; what a beam search cannot
take (a stream, logprobs) is a 400 naming it."""

from __future__ import annotations

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


@pytest.mark.parametrize("field", [{"stream": True}, {"logprobs": 2}])
def test_what_a_beam_search_cannot_take_is_named(server: Server, field: dict[str, object]) -> None:
    with pytest.raises(openai.BadRequestError, match=next(iter(field))):
        openai_client(server).completions.create(
            model=DEFAULT_MODEL, prompt=PROMPTS[0], n=2, max_tokens=4,
            extra_body={"use_beam_search": True}, **field,  # type: ignore[arg-type]
        )  # fmt: skip
