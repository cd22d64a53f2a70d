"""Tool calling on the chat endpoint: a request's `tools` and `tool_choice` checked, the
constraint a forced call runs under, and the calls a choice made, whole or as the
stream's deltas (OpenAI's `message.tool_calls` and `delta.tool_calls`).

- `none`: the tools are rendered (as vLLM does), the answer is content;
- `auto`: the model decides; the server's `--tool-call-parser` finds calls in its text;
- `required`: the answer is a JSON array of `{"name", "parameters"}` objects, each one
  of the tools with arguments that fit its schema (a grammar holds it to that);
- named (`{"type": "function", "function": {"name": ...}}`): the answer is that
  function's arguments, JSON that fits its parameters' schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pyengine.engine.detokenizer import GrowingText
from pyengine.entrypoints.openai.errors import APIError
from pyengine.entrypoints.openai.tool_parsers import (
    NOT_JSON,
    ParsedMessage,
    ToolCall,
    ToolParser,
)
from pyengine.sampling_params import StructuredOutputsParams

Mode = Literal["none", "auto", "required", "named"]

# OpenAI's rule for a function's name
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# OpenAI: "Omitting parameters defines a function with an empty parameter list."
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    """What a request asked of its tools."""

    mode: Mode
    tools: list[dict[str, Any]] = field(default_factory=list)  # as the request gave them
    parameters: dict[str, dict[str, Any]] = field(default_factory=dict)  # by name
    name: str | None = None  # the named function
    parallel: bool = True

    @classmethod
    def of(
        cls,
        tools: list[Any] | None,
        tool_choice: Any,
        parallel_tool_calls: bool | None,
        auto_parser: ToolParser | None,
    ) -> ToolChoice:
        """Checks the request's fields; APIError naming the field that is wrong."""
        parameters = _check_tools(tools or [])
        if tool_choice is None:  # OpenAI's default
            tool_choice = "auto" if parameters else "none"
        name = None
        if isinstance(tool_choice, dict):
            function = tool_choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if tool_choice.get("type") != "function" or not isinstance(name, str):
                raise APIError(
                    'tool_choice must be "none", "auto", "required" or {"type": "function", '
                    '"function": {"name": ...}}', param="tool_choice",
                )  # fmt: skip
            if name not in parameters:
                raise APIError(
                    f"tool_choice names the function {name!r}, which is not one of the "
                    f"request's tools ({', '.join(parameters) or 'none given'})",
                    param="tool_choice",
                )
            mode: Mode = "named"
        elif tool_choice in ("none", "auto", "required"):
            mode = tool_choice
        else:
            raise APIError(
                f'tool_choice {tool_choice!r} is not one of "none", "auto", "required" or a '
                "named function", param="tool_choice",
            )  # fmt: skip
        if mode != "none" and not parameters:
            raise APIError(f"tool_choice {mode!r} needs tools", param="tool_choice")
        if mode == "auto" and auto_parser is None:
            raise APIError(
                '"auto" tool choice needs a server started with --enable-auto-tool-choice '
                'and --tool-call-parser (or ask for "required" or a named function)',
                param="tool_choice",
            )
        return cls(mode, list(tools or []), parameters, name, parallel_tool_calls is not False)

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar a forced call is sampled under."""
        if self.mode == "named":
            assert self.name is not None
            return StructuredOutputsParams(json=self.parameters[self.name])
        if self.mode != "required":
            return None
        # Each schema's definitions move to the list's top, where its "#/$defs/..."
        # references then point (as vLLM's): one name, one definition.
        definitions: dict[str, Any] = {}
        one_call = []
        for name, schema in self.parameters.items():
            own = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
            for key in ("$defs", "definitions"):
                for defined, definition in (schema.get(key) or {}).items():
                    if definitions.setdefault(defined, definition) != definition:
                        raise APIError(
                            f"tools: function {name!r} defines {defined!r} otherwise than "
                            "another tool does", param="tools",
                        )  # fmt: skip
            one_call.append({
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": own},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            })  # fmt: skip
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_call}}
        if not self.parallel:
            calls["maxItems"] = 1
        if definitions:
            calls["$defs"] = definitions
        return StructuredOutputsParams(json=calls)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (`tools`), or None for no tools."""
        return self.tools or None

    def parse(self, text: str, parser: ToolParser | None) -> ParsedMessage:
        """The calls in a whole answer (`parser` for auto), or its text as the content."""
        if self.mode == "named":
            assert self.name is not None
            return ParsedMessage(None, [ToolCall(self.name, text)])
        if self.mode == "required":
            return _parse_required(text)
        if self.mode == "auto" and parser is not None:
            parsed = parser.parse(text)
            if not self.parallel:  # (as vLLM: the first call)
                return ParsedMessage(parsed.content, parsed.tool_calls[:1])
            return parsed
        return ParsedMessage(text, [])


def _check_tools(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """Each function's parameters' schema by its name; APIError naming the tool at fault."""
    parameters: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(
                f'{where} must be {{"type": "function", "function": ...}}', param="tools"
            )
        if not isinstance(function, dict):
            raise APIError(f"{where}.function must be an object", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise APIError(
                f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}",
                param="tools",
            )
        if name in parameters:
            raise APIError(f"{where}: two tools are named {name!r}", param="tools")
        schema = function.get("parameters") or _NO_PARAMETERS  # (null and {}: none, as vLLM)
        problem = _schema_problem(schema)
        if problem:
            raise APIError(
                f"{where}.function.parameters must be a JSON schema object: {problem}",
                param="tools",
            )
        parameters[name] = schema
    return parameters


_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def _schema_problem(schema: Any) -> str | None:
    """What makes `schema` no JSON schema, in the keywords every function's schema uses
    (the grammar backend checks the rest where a forced call compiles it)."""
    if not isinstance(schema, dict):
        return f"got {type(schema).__name__}"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    unknown = [k for k in kinds if not isinstance(k, str) or k not in _JSON_TYPES]
    if unknown:
        return f"type {unknown[0]!r} is not a JSON type"
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(
        isinstance(p, dict | bool) for p in properties.values()
    ):
        return "properties must map names to schemas"
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return "required must be a list of names"
    return None


def _parse_required(text: str) -> ParsedMessage:
    """A `required` answer: the array its grammar holds it to (unparsed where it was cut
    short)."""
    try:
        calls = [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                 for c in json.loads(text)]  # fmt: skip
    except (*NOT_JSON, TypeError, KeyError):
        return ParsedMessage(text, [])
    return ParsedMessage(None, calls)


def finish_reason(choice: ToolChoice, parsed: ParsedMessage, reason: str | None) -> str | None:
    """OpenAI's: "tool_calls" where the model chose to call (auto, required) and ended by
    itself; a named call ends with "stop", and a cut-short answer keeps "length"."""
    if parsed.tool_calls and reason == "stop" and choice.mode != "named":
        return "tool_calls"
    return reason


class ToolCallStream:
    """One choice's deltas, as the stream goes: content while it surely is content, a
    named call's arguments as they come, other calls once the answer is whole (what is
    sent adds up to the whole answer's message)."""

    def __init__(self, choice: ToolChoice, parser: ToolParser | None) -> None:
        self.choice = choice
        self.parser = parser if choice.mode == "auto" else None
        self.scanner = None if self.parser is None else self.parser.content_scanner()
        self.text = GrowingText()  # (its pieces: growing one string copies it whole)
        self.sent = 0  # characters of the text sent as content (or as named arguments)
        self.blank = 0  # the text's first characters known blank (while none is sent)
        self.named_call: ToolCall | None = None
        self.parsed: ParsedMessage | None = None  # the whole answer's, once it ends

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas that `text` (the next piece of the answer) lets the stream send;
        each piece is looked at once (the whole answer again only when it ends)."""
        self.text.append(text)
        length = self.text.length
        end = length if self.scanner is None else self.scanner.feed(text)
        mode = self.choice.mode
        if finished:
            self.parsed = self.choice.parse(self.text.whole(), self.parser)
        if mode == "none":
            return self._content(length)
        if mode == "named":
            return self._named(text)
        if self.parsed is not None:
            calls = self.parsed.tool_calls
            return self._content(len(self.parsed.content or "") if calls else length) + (
                _call_deltas(calls)
            )
        if mode == "required":
            return []
        if self.sent == 0 and end > self.blank:  # (blank content before a call is none)
            unread = self.text.since(self.blank)[: end - self.blank]
            self.blank = self.blank if unread.strip() else end
        if self.sent == 0 and end <= self.blank:
            return []
        return self._content(end)

    def finish_reason(self, reason: str | None) -> str | None:
        """The finish reason of the answer deltas() was told is whole."""
        assert self.parsed is not None
        return finish_reason(self.choice, self.parsed, reason)

    def _content(self, end: int) -> list[dict[str, Any]]:
        if end <= self.sent:
            return []
        piece, self.sent = self.text.since(self.sent)[: end - self.sent], end
        return [{"content": piece}]

    def _named(self, text: str) -> list[dict[str, Any]]:
        if self.named_call is None:
            assert self.choice.name is not None
            self.named_call = ToolCall(self.choice.name, "")
            return [{"tool_calls": [_call_json(0, self.named_call, text)]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []


def _call_json(index: int, call: ToolCall, arguments: str) -> dict[str, Any]:
    return {"index": index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": arguments}}  # fmt: skip


def _call_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"tool_calls": [_call_json(i, c, c.arguments)]} for i, c in enumerate(calls)]
