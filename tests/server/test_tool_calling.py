"""Tool calling end to end, through the official openai client against the server run
as a user runs it, with the default model and a chat template that renders tools
(helpers/tool_chat_template.jinja: Hermes' format) and `--enable-auto-tool-choice
--tool-call-parser hermes`: named, required and auto calls, whole and streamed, a
conversation that goes on after a tool's result, and bad tools answered 400."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from helpers.server import OUTSIDE_SOURCE_TREE, Server, openai_client, serving
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pyengine.loader.resolve import DEFAULT_MODEL

jsonschema = pytest.importorskip("jsonschema")

TEMPLATE = Path(__file__).parents[1] / "helpers" / "tool_chat_template.jinja"
SHORT = {"type": "string", "maxLength": 16}


def _function(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    # Bounded values and no other properties: a small model's answer ends in max_tokens.
    schema = {"type": "object", "properties": properties, "required": list(properties),
              "additionalProperties": False}  # fmt: skip
    function = {"name": name, "description": description, "parameters": schema}
    return {"type": "function", "function": function}


TOOLS = [
    _function("get_weather", "The current weather in a city",
              {"city": SHORT, "unit": {"enum": ["celsius", "fahrenheit"]}}),
    _function("get_time", "The time now in a time zone", {"zone": SHORT}),
    _function("book_table", "Books a table at a restaurant",
              {"people": {"type": "integer", "minimum": 1, "maximum": 12},
               "date": {"type": "string", "pattern": "^2026-[0-9]{2}-[0-9]{2}$"}}),
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What's the weather like in Paris today?"}]
# Steers an "auto" answer into a call as the template teaches it (the 135M model rarely
# calls by itself): the server must still find the call in the text.
FORCED_HERMES_CALL = {
    "guided_regex": r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": '
    r'"[A-Z][a-z]{2,10}", "unit": "(celsius|fahrenheit)"\}\}\n</tool_call>'
}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serving(
        extra=["--chat-template", str(TEMPLATE), "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes"],
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai_client(server)


def ask(client: openai.OpenAI, tool_choice: Any, **kw: Any) -> Any:
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(
        model=DEFAULT_MODEL, messages=kw.pop("messages", QUESTION), tools=TOOLS,
        tool_choice=tool_choice, max_tokens=kw.pop("max_tokens", 120), **kw,
    )  # fmt: skip


def check_call(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_named_calls_fit_their_functions_schema(client: openai.OpenAI, temperature: float) -> None:
    for seed, name in enumerate(SCHEMAS):
        choice = ask(client, named(name), temperature=temperature, seed=seed).choices[0]
        assert choice.finish_reason == "stop", choice  # (as OpenAI's, for a named call)
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == name
        check_call(call)


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_required_calls_are_some_of_the_tools(client: openai.OpenAI, temperature: float) -> None:
    for seed in range(4):
        choice = ask(
            client, "required", temperature=temperature, seed=seed, parallel_tool_calls=False
        ).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls  # (parallel_tool_calls false: one)
        check_call(call)
    for seed in range(4):  # several calls may come; every one complete fits its schema
        choice = ask(client, "required", temperature=temperature, seed=seed).choices[0]
        if choice.finish_reason == "length":  # (a list run on to max_tokens: no call)
            assert not choice.message.tool_calls and choice.message.content
            continue
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call)


def test_auto_answers_in_text_or_calls(client: openai.OpenAI) -> None:
    plain = ask(client, "auto", max_tokens=40).choices[0]
    assert not plain.message.tool_calls and plain.message.content
    assert "<|im_end|>" not in plain.message.content  # (special tokens are kept for parsers)
    called = ask(client, "auto", extra_body=FORCED_HERMES_CALL).choices[0]
    assert called.finish_reason == "tool_calls" and called.message.content is None
    (call,) = called.message.tool_calls
    assert call.function.name == "get_weather"
    check_call(call)
    # tool_choice "none": the same request's text is the content, not a call.
    text = ask(client, "none", extra_body=FORCED_HERMES_CALL).choices[0]
    assert text.finish_reason == "stop" and not text.message.tool_calls
    assert text.message.content.startswith("<tool_call>")


def reassembled(client: openai.OpenAI, tool_choice: Any, **kw: Any) -> tuple[Any, ...]:
    """A streamed answer as a client joins it: content, calls (name, arguments), finish."""
    content, calls, finish = "", {}, None
    ids: dict[int, str] = {}
    for chunk in ask(client, tool_choice, stream=True, **kw):
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.id is not None:
                ids[call.index] = call.id
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    assert all(i.startswith("call_") for i in ids.values())
    return content or None, [tuple(c) for c in calls.values()], finish


def test_streamed_deltas_reassemble_to_the_same_call(client: openai.OpenAI) -> None:
    cases = [
        (named("book_table"), {}),
        ("required", {"parallel_tool_calls": False}),
        ("auto", {"extra_body": FORCED_HERMES_CALL}),
        ("auto", {"max_tokens": 30}),
    ]
    for tool_choice, kw in cases:
        whole = ask(client, tool_choice, **kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        want = (whole.message.content, calls, whole.finish_reason)
        assert reassembled(client, tool_choice, **kw) == want, tool_choice


def test_required_calls_of_tools_with_definitions(client: openai.OpenAI) -> None:
    """Schemas with $defs (as pydantic writes them): a forced list of calls refers to
    each one's definitions, moved to the list's top."""
    city = {"type": "object", "properties": {"name": SHORT}, "required": ["name"],
            "additionalProperties": False}  # fmt: skip
    trip = {"type": "object", "properties": {"start": {"$ref": "#/$defs/City"},
            "end": {"$ref": "#/$defs/City"}}, "required": ["start", "end"],
            "additionalProperties": False, "$defs": {"City": city}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "plan_trip", "parameters": trip}},
             *TOOLS[1:2]]  # fmt: skip
    answer = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=QUESTION, tools=tools, tool_choice="required",
        parallel_tool_calls=False, max_tokens=80, temperature=0,
    ).choices[0]  # fmt: skip
    assert answer.finish_reason == "tool_calls"
    (call,) = answer.message.tool_calls
    schema = {**trip} if call.function.name == "plan_trip" else SCHEMAS["get_time"]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_conversation_goes_on_after_a_tools_result(server: Server, client: openai.OpenAI) -> None:
    first = ask(client, named("get_weather")).choices[0].message
    call = first.tool_calls[0]
    conversation = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21, "sky": "clear"}'},
    ]
    answer = ask(client, "auto", messages=conversation, max_tokens=40)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The server's prompt is the template's text of the tools, the call and its result.
    for_template = [*conversation[:1], {**conversation[1], "content": ""}, conversation[2]]
    for_template[1]["tool_calls"] = [
        {**call.model_dump(), "function": {"name": call.function.name,
                                           "arguments": json.loads(call.function.arguments)}}
    ]  # fmt: skip
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    text = env.from_string(TEMPLATE.read_text()).render(
        messages=for_template, tools=TOOLS, add_generation_prompt=True
    )
    assert "<tool_response>\n{" in text and call.function.arguments[:8] in text.replace(" ", "")
    status, tokens = server.request(
        "POST", "/tokenize", json.dumps({"prompt": text, "add_special_tokens": False})
    )
    assert status == 200 and answer.usage.prompt_tokens == tokens["count"]


@pytest.mark.parametrize(
    ("body", "needle", "param"),
    [({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
       "tool_choice": "required"}, "tools[0].function.parameters must be a JSON schema", "tools"),
     ({"tools": [{"type": "function", "function": {"name": "f",
                                                   "parameters": {"type": "objectx"}}}]},
      "tools[0].function.parameters must be a JSON schema object: type 'objectx'", "tools"),
     ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
         "type": "object", "properties": {"a": {"type": "string", "pattern": "[a-"}}}}}],
       "tool_choice": "required"}, "tools: the parameters' schema is not valid", "tools"),
     ({"tools": TOOLS, "tool_choice": named("send_email")}, "'send_email', which is not one",
      "tool_choice"),
     ({"tool_choice": "required"}, "needs tools", "tool_choice"),
     ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
      "give one structured output constraint", "response_format"),
     ({"messages": [*QUESTION, {"role": "tool", "content": "22 C"}]}, "needs the tool_call_id",
      "messages")],
)  # fmt: skip
def test_bad_tools_answer_400(
    server: Server, body: dict[str, Any], needle: str, param: str
) -> None:
    ok, _ = server.request("POST", "/v1/chat/completions",
                           json.dumps({"messages": QUESTION, "max_tokens": 2}))  # fmt: skip
    assert ok == 200  # (before and after a refused request: the server serves)
    prompts = 'prompt_tokens_total{model_name="SmolLM2-135M-Instruct"}'
    before = server.idle_metrics()[prompts]
    got, error = server.request(
        "POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, **body})
    )
    assert got == 400 and needle in error["error"]["message"], error
    assert error["error"]["param"] == param
    assert server.idle_metrics()[prompts] == before  # nothing entered the engine


def test_auto_tool_choice_needs_a_parser() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pyengine.entrypoints.openai.api_server",
         "--enable-auto-tool-choice"],
        capture_output=True, text=True, cwd=OUTSIDE_SOURCE_TREE, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "--enable-auto-tool-choice needs --tool-call-parser" in done.stderr
