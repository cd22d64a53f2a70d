"""A thinking model's reasoning apart from its answer, end to end: the server run as a
user runs it with `--reasoning-parser qwen3` and `--enable-auto-tool-choice
--tool-call-parser hermes`, the default model's answer steered (a regex that constrains
the reasoning too: `--structured-outputs-in-reasoning`) into Qwen3's form, `<think>` ...
`</think>` then the answer. The official openai client gets the reasoning in
`reasoning_content` and the answer alone in `content`, whole and streamed alike; a tool
call written while thinking is not a call, one in the answer is.

Then a thinking budget (`--reasoning-parser deepseek_r1`, whose reasoning runs from the
answer's start to `</think>`): max_thinking_tokens (or reasoning_effort) ends the
reasoning with `</think>` after that many free tokens, and a structured output
constrains the answer after it alone."""

from __future__ import annotations

import json
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
               "--tool-call-parser", "hermes", "--structured-outputs-in-reasoning"],
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


@pytest.fixture(scope="module")
def budget_server() -> Iterator[Server]:
    yield from serving(extra=["--reasoning-parser", "deepseek_r1"])


def free_text(server: Server, count: int) -> str:
    """The text of the model's first `count` greedy tokens after the chat's prompt,
    unconstrained (the prompt's tokens from /tokenize, run as a completion)."""
    status, tokenized = server.request("POST", "/tokenize", json.dumps(
        {"model": DEFAULT_MODEL, "messages": QUESTION}))  # fmt: skip
    assert status == 200, tokenized
    out = openai_client(server).completions.create(
        model=DEFAULT_MODEL, prompt=tokenized["tokens"], temperature=0, max_tokens=count
    )
    return out.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_a_thinking_budget_ends_the_reasoning_and_the_grammar_takes_the_answer(
    budget_server: Server, stream: bool
) -> None:
    client = openai_client(budget_server)
    options: dict[str, Any] = dict(
        model=DEFAULT_MODEL, messages=QUESTION, temperature=0, max_tokens=48,
        extra_body={"max_thinking_tokens": 6, "guided_regex": ANSWER},
    )  # fmt: skip
    if stream:
        deltas = [c.choices[0].delta for c in client.chat.completions.create(
            **options, stream=True) if c.choices]  # fmt: skip
        reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    else:
        message = client.chat.completions.create(**options).choices[0].message
        reasoning, content = message.model_extra["reasoning_content"], message.content
    # The reasoning: the model's own six free tokens (no grammar on them), then the end.
    assert reasoning == free_text(budget_server, 6)
    assert re.fullmatch(ANSWER, content), content


def test_reasoning_effort_and_bad_budgets(budget_server: Server) -> None:
    client = openai_client(budget_server)
    answer = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=QUESTION, temperature=0, max_tokens=24,
        reasoning_effort="minimal", extra_body={"guided_regex": ANSWER},
    ).choices[0].message  # fmt: skip
    assert not answer.model_extra.get("reasoning_content") and re.fullmatch(ANSWER, answer.content)
    for body, param in (({"max_thinking_tokens": -1}, "max_thinking_tokens"),
                        ({"max_thinking_tokens": 3, "thinking_token_budget": 3},
                         "max_thinking_tokens"),
                        ({"reasoning_effort": "extreme"}, "reasoning_effort")):  # fmt: skip
        status, error = budget_server.request("POST", "/v1/chat/completions", json.dumps(
            {"model": DEFAULT_MODEL, "messages": QUESTION, **body}))  # fmt: skip
        assert status == 400, error
        assert error["error"]["param"] == param, error


def test_a_budget_needs_a_reasoning_parser(server: Server) -> None:
    """(the qwen3 server, whose grammar constrains the reasoning too, refuses a budget
    beside a structured output; a server without a parser refuses any budget, below)"""
    status, error = server.request("POST", "/v1/chat/completions", json.dumps({
        "model": DEFAULT_MODEL, "messages": QUESTION, "max_thinking_tokens": 4,
        "guided_regex": ANSWER}))  # fmt: skip
    assert status == 400 and error["error"]["param"] == "max_thinking_tokens"
