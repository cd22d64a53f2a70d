"""Tool calls parsed from a model's text (`--tool-call-parser`, vLLM's names): the
formats the chat templates of today's open models teach them.

- `hermes` (Hermes, Qwen 2.5 and 3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, any text before them the message's content;
- `llama3_json` (Llama 3.1 and later): the whole answer a JSON object `{"name": ...,
  "parameters": {...}}`, or several separated by `;`, after an optional `<|python_tag|>`;
- `pythonic` (Llama 3.2 and 4's pythonic templates): the whole answer a Python list of
  calls, `[get_weather(city="Paris"), now()]`, literals as arguments;
- `openai` (gpt-oss's harmony messages, with `--reasoning-parser gpt_oss`): each message
  to `functions.name` a call, its message the arguments' JSON.

A parser that finds no call leaves the text as the content; a call that does not parse
(truncated JSON, a non-literal argument) leaves the text as it is too, never a partial
call. While a stream runs, the parser's content scanner (content_scanners.py) says how
much of the text so far is surely content (no call can start in it), so that it can be
sent before the answer ends.
"""

from __future__ import annotations

import ast
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from pyengine.entrypoints.openai.content_scanners import (
    ContentScanner,
    MarkerScanner,
    WholeAnswerScanner,
)
from pyengine.entrypoints.openai.reasoning_parsers import CALL_END, CALL_OPEN
from pyengine.utils.registry import make_named


@dataclass(frozen=True)
class ToolCall:
    """One call, as OpenAI's message.tool_calls[i] holds it."""

    name: str
    arguments: str  # a JSON object's text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None  # the text that is not a call (None where there is none)
    tool_calls: list[ToolCall]


class ToolParser(Protocol):
    def parse(self, text: str) -> ParsedMessage: ...

    def content_scanner(self) -> ContentScanner:
        """A stream's follower of how much of its answer is surely content."""
        ...


def _call(name: object, arguments: object) -> ToolCall | None:
    """A call of a name (a string) with arguments (a dict, or its JSON text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except NOT_JSON:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    try:
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))
    except (TypeError, ValueError):  # (a Python literal JSON has no form for: a set, bytes)
        return None


# What json raises for text that is not JSON it can read: malformed, an integer past
# its digit limit (a plain ValueError), nesting past the interpreter's recursion limit.
NOT_JSON = (ValueError, RecursionError)


def _unparsed(text: str) -> ParsedMessage:
    return ParsedMessage(text, [])


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"

    def content_scanner(self) -> ContentScanner:
        return MarkerScanner(self.START)

    def parse(self, text: str) -> ParsedMessage:
        start = text.find("<tool_call>")
        if start < 0:
            return _unparsed(text)
        calls = []
        for body in _blocks(text, start, self.START, self.END):
            try:
                payload = json.loads(body)
            except NOT_JSON:
                return _unparsed(text)
            call = _call(payload.get("name"), payload.get("arguments", {})) if isinstance(
                payload, dict) else None  # fmt: skip
            if call is None:
                return _unparsed(text)
            calls.append(call)
        content = text[:start]  # (as streamed: up to the first block)
        return ParsedMessage(content if content.strip() else None, calls)


def _blocks(text: str, at: int, opening: str, closing: str) -> Iterator[str]:
    """Each block's body from `at` on, stripped (the last may be unclosed). Found by plain
    searches, in linear time: a regular expression's backtracking over the model's
    whitespace was quadratic in it."""
    while (start := text.find(opening, at)) >= 0:
        body_from = start + len(opening)
        end = text.find(closing, body_from)
        if end < 0:
            yield text[body_from:].strip()
            return
        yield text[body_from:end].strip()
        at = end + len(closing)


class HarmonyToolParser:
    """gpt-oss's calls, with `--reasoning-parser gpt_oss`: it leaves each message to a
    function in the content as `<|channel|>commentary to=functions.name<|message|>{...}
    <|call|>` (any text before the first is the content)."""

    def content_scanner(self) -> ContentScanner:
        return MarkerScanner(CALL_OPEN)

    def parse(self, text: str) -> ParsedMessage:
        start = text.find(CALL_OPEN)
        if start < 0:
            return _unparsed(text)
        calls = []
        for body in _blocks(text, start, CALL_OPEN, CALL_END):
            recipient, found, arguments = body.partition("<|message|>")
            name = recipient.strip().removeprefix("functions.")
            call = _call(name, arguments.strip() or "{}") if found else None
            if call is None:
                return _unparsed(text)
            calls.append(call)
        content = text[:start]
        return ParsedMessage(content if content.strip() else None, calls)


class Llama3JsonToolParser:
    TAG = "<|python_tag|>"

    def content_scanner(self) -> ContentScanner:
        return WholeAnswerScanner((self.TAG, "{"))

    def parse(self, text: str) -> ParsedMessage:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return _unparsed(text)
        calls = []
        decoder = json.JSONDecoder()
        at = 0
        while at < len(body):
            try:
                payload, end = decoder.raw_decode(body, at)
            except NOT_JSON:
                return _unparsed(text)
            if not isinstance(payload, dict):
                return _unparsed(text)
            arguments = payload.get("parameters", payload.get("arguments", {}))
            call = _call(payload.get("name"), arguments)
            if call is None:
                return _unparsed(text)
            calls.append(call)
            rest = body[end:].lstrip()
            if not rest:
                break
            if not rest.startswith(";"):
                return _unparsed(text)
            at = len(body) - len(rest[1:].lstrip())
        return ParsedMessage(None, calls)


class PythonicToolParser:
    def content_scanner(self) -> ContentScanner:
        return WholeAnswerScanner(("<|python_start|>", "["))

    def parse(self, text: str) -> ParsedMessage:
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>")
        body = body.strip()
        if not (body.startswith("[") and body.endswith("]")):
            return _unparsed(text)
        try:
            tree = ast.parse(body, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):  # (NUL, deep nesting)
            return _unparsed(text)
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return _unparsed(text)
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
                return _unparsed(text)  # (positional arguments have no parameter names)
            try:
                arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            except (ValueError, TypeError, SyntaxError, RecursionError):  # (not a literal)
                return _unparsed(text)
            if None in arguments:  # (**kwargs)
                return _unparsed(text)
            call = _call(node.func.id, arguments)
            if call is None:
                return _unparsed(text)
            calls.append(call)
        return ParsedMessage(None, calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "pythonic": PythonicToolParser,
    "openai": HarmonyToolParser,
}


def tool_parser(name: str) -> ToolParser:
    """The parser of `--tool-call-parser name`; ValueError naming the known ones."""
    return make_named(TOOL_PARSERS, name, "--tool-call-parser")
