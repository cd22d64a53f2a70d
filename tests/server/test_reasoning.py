"""A thinking model's reasoning apart from its answer, end to end: the server run as a
user runs it with `--reasoning-parser qwen3` and `--enable-auto-tool-choice
--tool-call-parser hermes`, the default model's answer steered (a regex) into Qwen3's
form, `<think>` ... `</think>` then the answer. The official openai client gets the
reasoning in `reasoning_content` and the answer alone in `content`, whole and streamed
alike; a tool call written while thinking is not a call, one in the answer is."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.server import Server, openai_client, serving

from pyengine.loader.resolve import DEFAULT_MODEL

THINKING = r"<think>\n[a-z]{3,8}( [a-z]{3,8}){2,5}\.\n</think>\n\n"
ANSWER = r"[A-Z][a-z]{2,8}( [a-z]{2,8}){1,4}\."
QUESTION = [{"role": "user", "content": "Is Paris in France?"}]
CALL = (
    r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "[A-Z][a-z]{2,8}"\}\}\n</tool_call>'
)
TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                   "required": ["zone"]}}}]  # fmt: skip


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serving(
        extra=["--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes"],
    )  # fmt: skip


def ask(server: Server, regex: str, stream: bool = False, **options: Any) -> Any:
    return openai_client(server).chat.completions.create(
        model=DEFAULT_MODEL, messages=QUESTION, temperature=0, max_tokens=96, stream=stream,
        extra_body={"guided_regex": regex}, **options,
    )  # fmt: skip


def test_the_reasoning_comes_apart_from_the_answer_whole_and_streamed(server: Server) -> None:
    message = ask(server, THINKING + ANSWER).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert re.fullmatch(r"\n[a-z ]+\.\n", reasoning) and "think>" not in message.content
    assert re.fullmatch(r"\n\n" + ANSWER, message.content)
    chunks = list(ask(server, THINKING + ANSWER, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert streamed == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    # (the reasoning goes out before any of the answer)
    first_content = next(k for k, d in enumerate(deltas) if d.content)
    assert all(not (d.model_extra or {}).get("reasoning_content")
               for d in deltas[first_content:])  # fmt: skip


def test_tool_calls_are_parsed_from_the_answer_only(server: Server) -> None:
    called = ask(server, THINKING + CALL, tools=TOOLS).choices[0]
    assert called.finish_reason == "tool_calls"
    assert called.message.tool_calls[0].function.name == "get_time"
    assert called.message.model_extra["reasoning_content"]
    thought = (
        r"<think>\n" + CALL[: -len(r"\n</tool_call>")] + r"\n</tool_call>\n</think>\n\n" + ANSWER
    )
    answered = ask(server, thought, tools=TOOLS).choices[0]
    assert answered.finish_reason == "stop" and not answered.message.tool_calls
    assert "<tool_call>" in answered.message.model_extra["reasoning_content"]
