"""Tool calling's request side and answers without a server: tools and tool_choice
checked (400s naming the field), the grammar a forced call runs under, and streamed
deltas that add up to the whole answer's message for every mode and parser, however the
text is cut into pieces."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import pytest

from pyengine.entrypoints.openai.errors import APIError
from pyengine.entrypoints.openai.protocol import ChatMessage
from pyengine.entrypoints.openai.tool_calls import ToolCallStream, ToolChoice, finish_reason
from pyengine.entrypoints.openai.tool_parsers import ParsedMessage, tool_parser

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},  # (no parameters: none taken)
]


def choice(tool_choice: Any, parser: str | None = "hermes", **kw: Any) -> ToolChoice:
    auto = tool_parser(parser) if parser else None
    return ToolChoice.of(kw.get("tools", TOOLS), tool_choice, kw.get("parallel"), auto)


def test_modes_and_their_grammars() -> None:
    assert choice(None).mode == "auto" and choice(None, tools=[]).mode == "none"
    assert choice("none").constraint() is None and choice("auto").constraint() is None
    named = choice({"type": "function", "function": {"name": "get_weather"}})
    assert named.mode == "named" and named.constraint().json == WEATHER  # type: ignore[union-attr]
    required = choice("required").constraint().json  # type: ignore[union-attr]
    assert required["minItems"] == 1 and "maxItems" not in required
    names = [c["properties"]["name"]["const"] for c in required["items"]["anyOf"]]
    assert names == ["get_weather", "now"]
    assert required["items"]["anyOf"][1]["properties"]["parameters"] == {
        "type": "object", "properties": {}}  # fmt: skip
    one = choice("required", parallel=False).constraint().json  # type: ignore[union-attr]
    assert one["maxItems"] == 1


@pytest.mark.parametrize(
    ("tools", "tool_choice", "parser", "needle", "param"),
    [([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "required",
      "hermes", "tools[0].function.parameters must be a JSON schema object", "tools"),
     ([{"type": "retrieval"}], "required", "hermes", 'tools[0] must be {"type": "function"',
      "tools"),
     ([{"type": "function", "function": {"name": "a b"}}], "required", "hermes",
      "tools[0].function.name", "tools"),
     ([TOOLS[1], TOOLS[1]], "required", "hermes", "two tools are named 'now'", "tools"),
     (TOOLS, {"type": "function", "function": {"name": "nope"}}, "hermes",
      "'nope', which is not one of the request's tools (get_weather, now)", "tool_choice"),
     (TOOLS, {"type": "function"}, "hermes", "tool_choice must be", "tool_choice"),
     (TOOLS, "sometimes", "hermes", "is not one of", "tool_choice"),
     ([], "required", "hermes", "tool_choice 'required' needs tools", "tool_choice"),
     (TOOLS, "auto", None, "--enable-auto-tool-choice", "tool_choice"),
     (TOOLS, None, None, "--enable-auto-tool-choice", "tool_choice")],
)  # fmt: skip
def test_bad_tools_and_choices_name_the_field(
    tools: list[Any], tool_choice: Any, parser: str | None, needle: str, param: str
) -> None:
    with pytest.raises(APIError) as error:
        choice(tool_choice, parser, tools=tools)
    assert needle in error.value.message and error.value.param == param


def test_definitions_move_to_the_top_of_a_required_list() -> None:
    city = {"type": "object", "properties": {"name": {"type": "string"}}}
    ref = {"type": "object", "properties": {"to": {"$ref": "#/$defs/City"}},
           "$defs": {"City": city}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": n, "parameters": ref}}
             for n in ("go", "fly")]  # fmt: skip
    calls = choice("required", tools=tools).constraint().json  # type: ignore[union-attr]
    assert calls["$defs"] == {"City": city}
    for one in calls["items"]["anyOf"]:
        assert "$defs" not in one["properties"]["parameters"]
    other = {**ref, "$defs": {"City": {"type": "string"}}}
    tools[1]["function"]["parameters"] = other
    with pytest.raises(APIError, match="'fly' defines 'City' otherwise"):
        choice("required", tools=tools).constraint()


def test_no_parameters_and_one_call_without_parallel_calls() -> None:
    for none in (None, {}):
        tools = [{"type": "function", "function": {"name": "now", "parameters": none}}]
        assert choice("required", tools=tools).parameters["now"] == {
            "type": "object", "properties": {}}  # fmt: skip
    text = HERMES_CALL + HERMES_CALL
    assert len(choice("auto").parse(text, tool_parser("hermes")).tool_calls) == 2
    one = choice("auto", parallel=False).parse(text, tool_parser("hermes"))
    assert len(one.tool_calls) == 1


@pytest.mark.parametrize(
    ("parser", "text"),
    [("hermes", "<tool_call>" + "[" * 5000), ("hermes", '<tool_call>{"name": "f", "arguments": '
      + "1" * 5000 + "}"), ("llama3_json", '{"name": "f", "parameters": ' + "[" * 5000),
     ("pythonic", "[" * 5000 + "]" * 5000), ("pythonic", "[f(x='\x00')]")],
)  # fmt: skip
def test_what_json_or_python_cannot_read_is_content(parser: str, text: str) -> None:
    """Nesting past the recursion limit, an integer past JSON's digit limit, a NUL: the
    text stays whole as the content, never an error."""
    parsed = tool_parser(parser).parse(text)
    assert parsed.tool_calls == [] and parsed.content == text
    assert choice("required").parse("[" * 5000, None).content == "[" * 5000


def test_earlier_calls_and_tool_results_reach_the_template() -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    message = ChatMessage(role="assistant", content=None, tool_calls=[call]).to_template()
    assert message["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert message["content"] == ""
    result = ChatMessage(role="tool", content="22 C", tool_call_id="c1").to_template()
    assert result == {"role": "tool", "content": "22 C", "tool_call_id": "c1"}
    bad = [
        (ChatMessage(role="tool", content="22 C"), "needs the tool_call_id"),
        (ChatMessage(role="user", content="x", tool_calls=[call]), "only assistant messages"),
        (ChatMessage(role="assistant", tool_calls=[{"function": {"name": "f", "arguments": "{"}}]),
         "messages[3].tool_calls[0].function.arguments is not JSON"),
        (ChatMessage(role="assistant", tool_calls=[{"function": {"name": "f",
                                                                 "arguments": "[" * 5000}}]),
         "messages[3].tool_calls[0].function.arguments is not JSON"),
        (ChatMessage(role="assistant", tool_calls=[{"function": {"arguments": "{}"}}]),
         "messages[3].tool_calls[0] must be"),
    ]  # fmt: skip
    for message, needle in bad:
        with pytest.raises(APIError, match=needle.replace("[", r"\[")):
            message.to_template(3)


def whole(tools: ToolChoice, text: str, reason: str) -> tuple[ParsedMessage, str | None]:
    parser = tool_parser("hermes") if tools.mode == "auto" else None
    parsed = tools.parse(text, parser)
    return parsed, finish_reason(tools, parsed, reason)


def streamed(
    tools: ToolChoice, parser: str | None, pieces: list[str], reason: str
) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """What a client makes of the stream: the content, each call's name and arguments
    (joined by index, as OpenAI's clients join them), the finish reason."""
    stream = ToolCallStream(tools, tool_parser(parser) if parser else None)
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for i, piece in enumerate(pieces):
        for delta in stream.deltas(piece, i == len(pieces) - 1):
            content.append(delta.get("content", ""))
            for call in delta.get("tool_calls", []):
                entry = calls.setdefault(call["index"], ["", ""])
                if "id" in call:
                    assert call["id"].startswith("call_") and call["type"] == "function"
                    entry[0] = call["function"]["name"]
                entry[1] += call["function"]["arguments"]
    joined = [(name, arguments) for name, arguments in calls.values()]
    return "".join(content) or None, joined, stream.finish_reason(reason)


def cut(text: str, rng: random.Random) -> list[str]:
    """The text in random pieces (a token's text is one to a few characters, or none)."""
    pieces, at = [], 0
    while at < len(text):
        n = rng.choice([0, 1, 1, 2, 3, 7])
        pieces.append(text[at : at + n])
        at += n
    return [*pieces, ""]  # (the finishing update may bring no text)


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWERS = [
    ("hermes", "auto", "It is sunny.", "stop"),
    ("hermes", "auto", "Let me look.\n" + HERMES_CALL + HERMES_CALL, "stop"),
    ("hermes", "auto", "\n\n" + HERMES_CALL, "stop"),
    ("hermes", "auto", 'Broken: <tool_call>{"name": ', "length"),
    ("hermes", "auto", "a < b, <tool_ and more", "stop"),
    ("llama3_json", "auto", ' {"name": "now", "parameters": {}}', "stop"),
    ("llama3_json", "auto", '{"the answer": 4}', "stop"),
    ("pythonic", "auto", '[get_weather(city="Oslo"), now()]', "stop"),
    ("pythonic", "auto", "[1, 2, 3] are numbers", "stop"),
    (None, "required", '[{"name":"get_weather","parameters":{"city":"Rome"}}]', "stop"),
    (None, "required", '[{"name":"get_weather","param', "length"),
    (None, "named", '{"city":"Rome"}', "stop"),
    (None, "named", '{"city":"Ro', "length"),
    (None, "none", "  Just text.", "stop"),
]


@pytest.mark.parametrize(("parser", "mode", "text", "reason"), ANSWERS)
def test_streamed_deltas_add_up_to_the_whole_message(
    parser: str | None, mode: str, text: str, reason: str
) -> None:
    tool_choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    tools = choice(tool_choice if mode == "named" else mode, parser or "hermes")
    auto = tool_parser(parser) if parser else None
    parsed = tools.parse(text, auto)
    want_reason = finish_reason(tools, parsed, reason)
    want_calls = [(c.name, c.arguments) for c in parsed.tool_calls]
    rng = random.Random(text)
    for _ in range(20):
        assert streamed(tools, parser, cut(text, rng), reason) == (
            parsed.content, want_calls, want_reason)  # fmt: skip
    if reason == "stop":  # (a named call cut short streams its arguments as they came)
        assert all(isinstance(json.loads(a), dict) for _, a in want_calls)


def test_what_each_answer_becomes() -> None:
    auto = choice("auto")
    parsed, reason = whole(auto, "Let me look.\n" + HERMES_CALL, "stop")
    assert parsed.content == "Let me look.\n" and reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"})]  # fmt: skip
    parsed, reason = whole(choice("required"), '[{"name":"now","parameters":{}}]', "stop")
    assert parsed.content is None and reason == "tool_calls"
    # A forced call cut short is its text, with "length": never a call claimed complete.
    parsed, reason = whole(choice("required"), '[{"name":"now","para', "length")
    assert parsed.tool_calls == [] and reason == "length"
    named = choice({"type": "function", "function": {"name": "get_weather"}})
    parsed, reason = whole(named, '{"city":"Rome"}', "stop")
    assert reason == "stop" and parsed.tool_calls[0].arguments == '{"city":"Rome"}'
    # Text streamed in pieces that end inside a marker holds the marker's start back.
    stream = ToolCallStream(auto, tool_parser("hermes"))
    assert stream.deltas("Hi <tool", False) == [{"content": "Hi "}]
    assert stream.deltas("_call>", False) == []


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "pythonic"])
def test_a_long_stream_is_followed_in_linear_time(parser: str) -> None:
    """50k pieces, each looked at once: a stream's cost stays linear in its length (the
    whole text scanned again at every piece took minutes), and what is sent is the
    text, blank lines first included."""
    pieces = ["\n", "  "] + ["word "] * 50_000
    stream = ToolCallStream(choice("auto"), tool_parser(parser))
    start = time.perf_counter()
    sent = [d.get("content", "") for i, p in enumerate(pieces)
            for d in stream.deltas(p, i == len(pieces) - 1)]  # fmt: skip
    assert time.perf_counter() - start < 2.0
    assert "".join(sent) == "".join(pieces)
