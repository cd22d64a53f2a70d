"""The Responses API end to end, through the official openai client's
`responses.create` against the server run as a user runs it, with the default model, a
chat template that renders tools (Hermes' format) and a reasoning parser: a response
whole and streamed (the events reassemble to the whole response, which is the chat
completion's answer), a function call and its output in a second turn through
previous_response_id, a JSON schema as text.format, reasoning items, the store's GET and
DELETE (and, on the store alone, another key's responses not found), and bad input
answered 400."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from helpers.server import Server, openai_client, serving

from pyengine.entrypoints.openai.errors import APIError
from pyengine.entrypoints.openai.serving_responses import ResponseStore
from pyengine.loader.resolve import DEFAULT_MODEL

jsonschema = pytest.importorskip("jsonschema")

TEMPLATE = Path(__file__).parents[1] / "helpers" / "tool_chat_template.jinja"
QUESTION = "What's the weather like in Paris today?"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city"],
          "properties": {"city": {"type": "string", "maxLength": 16}}}  # fmt: skip
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": SCHEMA}]  # fmt: skip
FORCED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serving(
        extra=["--chat-template", str(TEMPLATE), "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
               "--structured-outputs-in-reasoning"],
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai_client(server)


def create(client: openai.OpenAI, **options: Any) -> Any:
    options = {"model": DEFAULT_MODEL, "input": QUESTION, "max_output_tokens": 24,
               "temperature": 0, **options}  # fmt: skip
    return client.responses.create(**options)


def test_a_response_is_the_chat_completions_answer_whole_and_streamed(
    client: openai.OpenAI,
) -> None:
    response = create(client, instructions="Answer briefly.")
    assert response.object == "response" and response.status in ("completed", "incomplete")
    assert [item.type for item in response.output] == ["message"]
    chat = client.chat.completions.create(
        model=DEFAULT_MODEL, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": QUESTION}],
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if cut else "completed")
    events = list(create(client, instructions="Answer briefly.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.incomplete" if cut else "response.completed")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text == events[-1].response.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert [e.text for e in done] == [response.output_text]


def test_a_function_call_then_its_output_in_a_second_turn(client: openai.OpenAI) -> None:
    called = create(client, tools=TOOLS, tool_choice=FORCED, max_output_tokens=64)
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    events = list(create(client, tools=TOOLS, tool_choice=FORCED, max_output_tokens=64,
                         stream=True))  # fmt: skip
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")  # fmt: skip
    assert arguments == call.arguments
    output = [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21"}]
    answer = create(client, input=output, previous_response_id=called.id, tools=TOOLS)
    assert answer.previous_response_id == called.id and answer.output_text
    # (the same turns given whole as input items)
    replayed = create(client, tools=TOOLS, input=[
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments}, *output])  # fmt: skip
    assert replayed.output_text == answer.output_text


def test_a_json_schema_format_and_reasoning_items(client: openai.OpenAI) -> None:
    shaped = create(client, max_output_tokens=48,
                    text={"format": {"type": "json_schema", "name": "weather",
                                     "schema": SCHEMA}})  # fmt: skip
    jsonschema.validate(json.loads(shaped.output_text), SCHEMA)
    steer = {"guided_regex": r"<think>\n[a-z]{3,8}( [a-z]{3,8}){2,4}\.\n</think>\n\nYes\."}
    thought = create(client, max_output_tokens=48, extra_body=steer)
    assert [item.type for item in thought.output] == ["reasoning", "message"]
    assert re.fullmatch(r"\n[a-z ]+\.\n", thought.output[0].content[0].text)
    assert thought.output_text == "\n\nYes."


def test_the_store_keeps_each_keys_responses(client: openai.OpenAI, server: Server) -> None:
    response = create(client)
    assert client.responses.retrieve(response.id).output_text == response.output_text
    unstored = create(client, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        create(client, previous_response_id=unstored.id)
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"input": []}, "input must not be empty"),
        ({"input": [{"role": "tool", "content": "x"}]}, "role must be user"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "'input_image'"),
        ({"tools": [{"type": "web_search"}]}, "only function tools"),
        ({"text": {"format": {"type": "xml"}}}, "text.format type 'xml'"),
        ({"temperature": 3}, "temperature must be in [0, 2]"),
    ],
)
def test_bad_requests_are_400s(client: openai.OpenAI, change: dict[str, Any], words: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, **change)
    assert words in caught.value.body["message"]


def test_a_stored_response_is_its_keys_alone_and_the_oldest_goes() -> None:
    store = ResponseStore(capacity=2)
    store.put({"id": "a"}, [{"role": "user", "content": "hi"}], owner=0)
    assert store.get("a", 0) == ({"id": "a"}, [{"role": "user", "content": "hi"}])
    with pytest.raises(APIError) as caught:
        store.get("a", 1)  # (another key's: not found)
    assert caught.value.status == 404
    store.put({"id": "b"}, [], owner=0)
    store.put({"id": "c"}, [], owner=0)
    assert list(store.items) == ["b", "c"]
