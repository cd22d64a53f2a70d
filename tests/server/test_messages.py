"""Anthropic's Messages API end to end, through the official anthropic client (its API
key in x-api-key) against the server run as a user runs it, with the default model, a
chat template that renders tools (Hermes' format) and a reasoning parser: a message
whole and streamed (the events add up to the whole message, which is the chat
completion's answer), a stop sequence, a forced tool call and a second turn with its
result, thinking blocks, token counting, and bad requests answered in Anthropic's error
shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.server import API_KEY, Server, openai_client, serving

from pyengine.loader.resolve import DEFAULT_MODEL

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

TEMPLATE = Path(__file__).parents[1] / "helpers" / "tool_chat_template.jinja"
QUESTION = [{"role": "user", "content": "What's the weather like in Paris today?"}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city"],
          "properties": {"city": {"type": "string", "maxLength": 16}}}  # fmt: skip
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serving(
        extra=["--chat-template", str(TEMPLATE), "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
               "--structured-outputs-in-reasoning"],
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


# (today's SDK names no temperature: greedy answers take it as a field of the body)
GREEDY = {"temperature": 0}


def create(client: Any, **options: Any) -> Any:
    options = {"model": DEFAULT_MODEL, "max_tokens": 24, "messages": QUESTION, **options}
    options["extra_body"] = {**GREEDY, **options.get("extra_body", {})}
    return client.messages.create(**options)


def test_a_message_is_the_chat_completions_answer_whole_and_streamed(
    client: Any, server: Server
) -> None:
    message = create(client)
    assert message.type == "message" and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    chat = openai_client(server).chat.completions.create(
        model=DEFAULT_MODEL, messages=QUESTION, max_tokens=24, temperature=0
    )
    assert message.content[0].text == chat.choices[0].message.content
    assert (
        message.stop_reason
        == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    )
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    with client.messages.stream(model=DEFAULT_MODEL, max_tokens=24, messages=QUESTION,
                                extra_body=GREEDY) as stream:  # fmt: skip
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds
    assert final.content[0].text == message.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (
        message.stop_reason, message.usage.output_tokens,
    )  # fmt: skip
    counted = client.messages.count_tokens(model=DEFAULT_MODEL, messages=QUESTION)
    assert counted.input_tokens == message.usage.input_tokens


def test_a_stop_sequence_is_named(client: Any) -> None:
    text = create(client).content[0].text
    sequence = text.split()[2]  # (a word from the middle of the greedy answer)
    stopped = create(client, stop_sequences=["zzqx", sequence])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == sequence
    assert text.startswith(stopped.content[0].text)


def test_a_forced_tool_call_and_its_result(client: Any) -> None:
    called = create(client, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
                    max_tokens=64)  # fmt: skip
    (use,) = [block for block in called.content if block.type == "tool_use"]
    assert called.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, SCHEMA)
    forced = {"type": "tool", "name": "get_weather"}
    with client.messages.stream(
        model=DEFAULT_MODEL,
        max_tokens=64,
        messages=QUESTION,
        extra_body=GREEDY,
        tools=TOOLS,
        tool_choice=forced,
    ) as stream:
        streamed = stream.get_final_message()  # fmt: skip
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]
    turn = [*QUESTION, {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": "Sunny, 21 degrees"}]}]  # fmt: skip
    answer = create(client, messages=turn, tools=TOOLS)
    assert answer.content and answer.content[0].type == "text"


def test_thinking_comes_as_a_thinking_block(client: Any) -> None:
    steer = {"guided_regex": r"<think>\n[a-z]{3,8}( [a-z]{3,8}){2,4}\.\n</think>\n\nYes\."}
    message = create(client, max_tokens=48, extra_body=steer)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[1].text == "\n\nYes."
    with client.messages.stream(model=DEFAULT_MODEL, max_tokens=48, messages=QUESTION,
                                extra_body={**GREEDY, **steer}) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    assert streamed.content[0].thinking == message.content[0].thinking


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"messages": []}, "messages must not be empty"),
        ({"messages": [{"role": "system", "content": "hi"}]}, "role must be user or assistant"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "'image' block"),
        ({"extra_body": {"temperature": 1.5}}, "temperature must be in [0, 1]"),
        ({"tool_choice": {"type": "some"}}, "tool_choice type 'some'"),
        ({"model": "nope"}, "nope"),
    ],
)
def test_bad_requests_are_anthropic_errors(client: Any, change: dict[str, Any], words: str) -> None:
    with pytest.raises(anthropic.APIStatusError) as caught:
        create(client, **change)
    body = caught.value.body
    assert body["type"] == "error", body
    assert body["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert words in body["error"]["message"]


def test_keys_and_missing_fields_are_anthropic_errors(server: Server) -> None:
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        create(wrong)
    assert caught.value.body["error"]["type"] == "authentication_error"
    status, body = server.request(
        "POST", "/v1/messages", json.dumps({"model": DEFAULT_MODEL, "messages": QUESTION})
    )
    assert status == 400 and body["type"] == "error", body  # (no max_tokens)
    assert body["error"]["type"] == "invalid_request_error" and "max_tokens" in str(body)
