"""The tool-call parsers (--tool-call-parser): each format's calls and content, several
calls, arguments as objects and as JSON text; text that is not a call, or a call that
does not parse, left whole as the content."""

from __future__ import annotations

import json
import time

import pytest

from pyengine.entrypoints.openai.tool_parsers import TOOL_PARSERS, tool_parser


def calls(text: str, parser: str) -> list[tuple[str, dict]]:  # type: ignore[type-arg]
    parsed = tool_parser(parser).parse(text)
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def test_hermes_blocks_and_the_content_before_them() -> None:
    weather = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    now = '{"name": "now", "arguments": "{}"}'
    text = f"Let me look.\n<tool_call>\n{weather}\n</tool_call>\n<tool_call>{now}</tool_call>"
    parsed = tool_parser("hermes").parse(text)
    assert parsed.content == "Let me look.\n"  # up to the block, as a stream sends it
    assert calls(text, "hermes") == [("get_weather", {"city": "Paris"}), ("now", {})]
    # The last block unclosed (the answer ended at the stop token) still parses.
    assert calls('<tool_call>{"name": "f", "arguments": {"x": 1}}', "hermes") == [("f", {"x": 1})]
    assert tool_parser("hermes").parse('<tool_call>{"name": "f"').tool_calls == []
    assert tool_parser("hermes").parse("No call here.").content == "No call here."


def test_hermes_parses_long_whitespace_in_linear_time() -> None:
    """A block of 200k spaces between two words: parsed (and refused) in milliseconds,
    where the earlier regular expression backtracked over it quadratically (minutes)."""
    text = "<tool_call>{" + " " * 200_000 + "x"
    start = time.perf_counter()
    parsed = tool_parser("hermes").parse(text)
    assert time.perf_counter() - start < 0.5
    assert parsed.tool_calls == [] and parsed.content == text


def test_llama3_json_objects_tag_and_separators() -> None:
    one = '{"name": "search", "parameters": {"query": "vLLM", "top": 3}}'
    assert calls(one, "llama3_json") == [("search", {"query": "vLLM", "top": 3})]
    assert calls("<|python_tag|>" + one, "llama3_json") == calls(one, "llama3_json")
    two = one + '; {"name": "now", "arguments": {}}'
    assert [name for name, _ in calls(two, "llama3_json")] == ["search", "now"]
    for text in ("The answer is 4.", one + " and more", '{"name": 3, "parameters": {}}',
                 '{"name": "f", "parameters": {"a": }'):  # fmt: skip
        parsed = tool_parser("llama3_json").parse(text)
        assert parsed.tool_calls == [] and parsed.content == text


def test_pythonic_lists_of_calls_with_literal_arguments() -> None:
    text = '[get_weather(city="Paris", days=3, units=None), book(seats=[1, 2], vip=True)]'
    assert calls(text, "pythonic") == [
        ("get_weather", {"city": "Paris", "days": 3, "units": None}),
        ("book", {"seats": [1, 2], "vip": True}),
    ]
    assert calls("[now()]", "pythonic") == [("now", {})]
    for text in ("[f(1)]", "[f(x=y)]", "f(x=1)", "[]", "[f(x=1)", "[f(**k)]", "[f(x={1, 2})]",
                 "Sure: [f(x=1)]"):  # fmt: skip
        parsed = tool_parser("pythonic").parse(text)
        assert parsed.tool_calls == [] and parsed.content == text, text


def test_calls_have_ids_and_openais_shape() -> None:
    parsed = tool_parser("pythonic").parse("[a(), b()]")
    first, second = (c.to_openai() for c in parsed.tool_calls)
    assert first["id"].startswith("call_") and first["id"] != second["id"]
    assert first == {"id": first["id"], "type": "function",
                     "function": {"name": "a", "arguments": "{}"}}  # fmt: skip


def test_an_unknown_parser_is_named() -> None:
    with pytest.raises(ValueError, match="not one of hermes, llama3_json, openai, pythonic"):
        tool_parser("mistral")
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "openai", "pythonic"]


HARMONY_CALLS = (
    "<|channel|>analysis<|message|>The user wants Paris's weather and the time.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
    "<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}<|call|>"
)


def test_gpt_oss_calls_through_the_harmony_reasoning_parser() -> None:
    """--reasoning-parser gpt_oss takes the analysis apart and leaves each message to a
    function in the content, whole or streamed in random pieces; --tool-call-parser
    openai reads the calls from it, the preamble before them the content."""
    import random

    from pyengine.entrypoints.openai.reasoning_parsers import reasoning_parser

    whole = reasoning_parser("gpt_oss").split(HARMONY_CALLS)
    assert whole.reasoning == "The user wants Paris's weather and the time."
    rng = random.Random()
    for _ in range(30):
        stream, cuts = reasoning_parser("gpt_oss").stream(), sorted(
            rng.randint(0, len(HARMONY_CALLS)) for _ in range(8))  # fmt: skip
        pieces = [HARMONY_CALLS[a:b] for a, b in zip([0, *cuts], [*cuts, len(HARMONY_CALLS)],
                                                     strict=True)]  # fmt: skip
        sent = [stream.feed(p, k == len(pieces) - 1) for k, p in enumerate(pieces)]
        assert "".join(s.content or "" for s in sent) == whole.content
    parsed = tool_parser("openai").parse(whole.content or "")
    assert parsed.content == "Checking both."
    assert calls(whole.content or "", "openai") == [("get_weather", {"city": "Paris"}),
                                                    ("now", {})]  # fmt: skip
    # A call cut off in its arguments is no call: the text stays the content.
    cut = whole.content[: whole.content.index('"Paris"')] if whole.content else ""
    assert tool_parser("openai").parse(cut).tool_calls == []
    assert tool_parser("openai").parse("The weather is fine.").content == "The weather is fine."
