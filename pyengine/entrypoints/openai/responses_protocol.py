"""The Responses API's request body (POST /v1/responses), and the chat completion it asks
for: `instructions` as the system prompt, the earlier turns of `previous_response_id`
(serving_responses.py keeps them), then `input` (a string, or items: messages with text
parts, function calls and their outputs), function `tools` and `tool_choice` as chat's,
`text.format` as the response format, `max_output_tokens` as max_tokens. The chat
completions' own extras (vLLM's: seed, guided_regex...) are taken where a client sends
them; `reasoning.effort` bounds a thinking model's reasoning where the server has a
reasoning parser (the chat's reasoning_effort); fields pyengine does not use (metadata,
truncation...) are accepted (metadata echoed back)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from pyengine.entrypoints.openai.errors import APIError
from pyengine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    joined_text,
    string_field,
)

_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None

    def effort(self) -> str | None:
        """reasoning.effort (None where not given)."""
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and effort not in ("minimal", "low", "medium", "high"):
            raise APIError(f"reasoning.effort must be minimal, low, medium or high, got "
                           f"{effort!r}", param="reasoning")  # fmt: skip
        return effort

    def turn_messages(self) -> list[dict[str, Any]]:
        """This turn's input as chat messages."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        if not self.input:
            raise APIError("input must not be empty", param="input")
        out: list[dict[str, Any]] = []
        for k, item in enumerate(self.input):
            where = f"input[{k}]"
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind == "message":
                out.append(_message(item, where))
            elif kind == "function_call":
                call = {"id": _string(item.get("call_id"), f"{where}.call_id"), "type": "function",
                        "function": {"name": _string(item.get("name"), f"{where}.name"),
                                     "arguments": _string(item.get("arguments", "{}"),
                                                          f"{where}.arguments")}}  # fmt: skip
                if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                    out[-1]["tool_calls"].append(call)  # (a turn's calls, together)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                out.append({"role": "tool", "tool_call_id": _string(item.get("call_id"),
                                                                    f"{where}.call_id"),
                            "content": _text(output, f"{where}.output")})  # fmt: skip
            elif kind == "reasoning":
                continue  # (earlier reasoning: templates leave it out)
            else:
                raise APIError(f"{where}: an item of type {kind!r} is not supported (message, "
                               "function_call, function_call_output)", param="input")  # fmt: skip
        return out

    def to_chat(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion of this turn after `history` (the earlier turns' messages)."""
        system = [] if self.instructions is None else [
            {"role": "system", "content": self.instructions}
        ]  # fmt: skip
        given = {"max_tokens": self.max_output_tokens, "temperature": self.temperature,
                 "top_p": self.top_p, "user": self.user,
                 "parallel_tool_calls": self.parallel_tool_calls}  # fmt: skip
        fields: dict[str, Any] = {
            **(self.model_extra or {}),  # (the chat completions' extras, where sent)
            "model": self.model, "n": 1, "stream": self.stream,
            "messages": [*system, *history, *self.turn_messages()],
            # (the stream's last chunk carries the usage that response.completed reports)
            "stream_options": {"include_usage": True} if self.stream else None,
            **{k: v for k, v in given.items() if v is not None},
            **_tools(self.tools, self.tool_choice), **_format(self.text),
        }  # fmt: skip
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as error:
            raise APIError(f"invalid request: {error.errors()[0].get('msg')}") from None


def _string(value: Any, where: str) -> str:
    return string_field(value, where, "input")


def _text(value: Any, where: str) -> str:
    """A string, or text parts joined."""
    return joined_text(value, where, "input", _TEXT_PARTS)


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise APIError(f"{where}.role must be user, system, developer or assistant, got "
                       f"{role!r}", param="input")  # fmt: skip
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def _tools(tools: list[Any] | None, choice: str | dict[str, Any] | None) -> dict[str, Any]:
    """Function tools and tool_choice as chat's fields."""
    fields: dict[str, Any] = {}
    if tools:
        functions = []
        for k, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function" or not isinstance(tool.get("name"), str):
                raise APIError(f"tools[{k}]: only function tools with a name are supported, got "
                               f"type {kind!r}", param="tools")  # fmt: skip
            function = {"name": tool["name"], "parameters": tool.get("parameters") or
                        {"type": "object", "properties": {}}}  # fmt: skip
            if isinstance(tool.get("description"), str):
                function["description"] = tool["description"]
            functions.append({"type": "function", "function": function})
        fields["tools"] = functions
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError('tool_choice must be "auto", "none", "required" or '
                           '{"type": "function", "name": ...}', param="tool_choice")  # fmt: skip
        fields["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        fields["tool_choice"] = choice
    return fields


def _format(text: dict[str, Any] | None) -> dict[str, Any]:
    """text.format as chat's response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        spec = {"name": fmt.get("name", "output"), "schema": fmt.get("schema")}
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    raise APIError(f"text.format type {kind!r} is not one of text, json_object, json_schema",
                   param="text")  # fmt: skip
