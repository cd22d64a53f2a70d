"""Anthropic's Messages API request bodies, and the chat completion each asks for: the
system prompt first, text blocks joined, an assistant's tool_use blocks as its tool
calls and a user's tool_result blocks as tool messages, tools as functions (their
input_schema the parameters), tool_choice's auto, any, tool and none as OpenAI's, the
stop sequences as stops, thinking on or off as the template's enable_thinking, and
output_config's JSON schema as the structured output. The sampling fields today's SDK no
longer names (temperature, top_p, top_k) are taken where a client sends them (its
extra_body), as are the chat completions' own extras (vLLM's: seed, min_p,
guided_regex...). Fields pyengine does not use (metadata, service_tier, output_config's
effort...) are accepted and ignored."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from pyengine.entrypoints.openai.errors import APIError
from pyengine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    joined_text,
    string_field,
)


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: the conversation whose prompt is counted."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Any]
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    def to_chat(self, **sampling: Any) -> ChatCompletionRequest:
        """The chat completion this conversation asks for (`sampling`: its other fields)."""
        fields: dict[str, Any] = {
            **(self.model_extra or {}),  # (the chat completions' extras, where sent)
            "model": self.model,
            "n": 1,  # (a message is one answer)
            "messages": chat_messages(self.system, self.messages),
            "chat_template_kwargs": _thinking(self.thinking),
            **_tools(self.tools, self.tool_choice),
            **sampling,
        }
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as error:
            raise APIError(f"invalid request: {error.errors()[0].get('msg')}") from None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # (the SDK's older name of its format)

    def to_chat(self, **sampling: Any) -> ChatCompletionRequest:
        if self.temperature is not None and not 0 <= self.temperature <= 1:
            raise APIError(
                f"temperature must be in [0, 1], got {self.temperature}", param="temperature"
            )
        if self.max_tokens < 1:
            raise APIError(f"max_tokens must be at least 1, got {self.max_tokens}",
                           param="max_tokens")  # fmt: skip
        options = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                   "stop": self.stop_sequences}  # fmt: skip
        user = (self.metadata or {}).get("user_id")
        schema = _output_schema(self.output_config, self.output_format)
        if schema is not None:
            sampling.setdefault("response_format", {"type": "json_schema",
                                                    "json_schema": {"schema": schema}})  # fmt: skip
        return super().to_chat(
            max_tokens=self.max_tokens, stream=self.stream,
            # (the stream's last chunk carries the usage that message_delta reports)
            stream_options={"include_usage": True} if self.stream else None,
            **{k: v for k, v in options.items() if v is not None},
            **({"user": user} if isinstance(user, str) else {}),
            **sampling,
        )  # fmt: skip


def _output_schema(config: dict[str, Any] | None, legacy: dict[str, Any] | None) -> Any:
    """The JSON schema the answer must follow (output_config's format), or None."""
    fmt = (config or {}).get("format") or legacy
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise APIError("output_config.format must be {\"type\": \"json_schema\", \"schema\": ...}",
                       param="output_config")  # fmt: skip
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise APIError("output_config.format.schema must be a JSON schema object",
                       param="output_config")  # fmt: skip
    return schema


def _text(value: Any, where: str) -> str:
    """A string, or text blocks joined (a system prompt, a tool result's content)."""
    return joined_text(value, where, "messages", ("text",))


def _string(value: Any, where: str) -> str:
    return string_field(value, where, "messages")


def chat_messages(system: str | list[Any] | None, messages: list[Any]) -> list[dict[str, Any]]:
    """The conversation as chat messages (OpenAI's form)."""
    out: list[dict[str, Any]] = []
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    if not messages:
        raise APIError("messages must not be empty", param="messages")
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise APIError(f"messages[{i}].role must be user or assistant, got {role!r}",
                           param="messages")  # fmt: skip
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise APIError(f"messages[{i}].content must be a string or a list of blocks",
                           param="messages")  # fmt: skip
        texts, calls, results = [], [], []
        for k, block in enumerate(blocks):
            where = f"messages[{i}].content[{k}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(_string(block.get("text"), f"{where}.text"))
            elif kind == "tool_use" and role == "assistant":
                calls.append(_call(block, where))
            elif kind == "tool_result" and role == "user":
                results.append({"role": "tool", "content": _text(block.get("content", ""), where),
                                "tool_call_id": _string(block.get("tool_use_id"),
                                                        f"{where}.tool_use_id")})  # fmt: skip
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # (earlier reasoning: templates leave it out)
            else:
                raise APIError(
                    f"{where}: a {kind!r} block is not supported in a {role} message (text, "
                    "tool_use from the assistant, tool_result from the user)", param="messages",
                )  # fmt: skip
        if role == "assistant":
            out.append({"role": "assistant", "content": "\n".join(texts) if texts else None,
                        **({"tool_calls": calls} if calls else {})})  # fmt: skip
            continue
        out.extend(results)  # (the calls' results first, as they answer the turn before)
        if texts or not results:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _call(block: dict[str, Any], where: str) -> dict[str, Any]:
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise APIError(f"{where}.input must be an object", param="messages")
    return {"id": _string(block.get("id"), f"{where}.id"), "type": "function",
            "function": {"name": _string(block.get("name"), f"{where}.name"),
                         "arguments": json.dumps(arguments)}}  # fmt: skip


def _tools(tools: list[Any] | None, choice: dict[str, Any] | None) -> dict[str, Any]:
    """tools and tool_choice as OpenAI's fields."""
    fields: dict[str, Any] = {}
    if tools:
        functions = []
        for k, tool in enumerate(tools):
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                raise APIError(f"tools[{k}] needs a name", param="tools")
            schema = tool.get("input_schema", {"type": "object"})
            if not isinstance(schema, dict):
                raise APIError(f"tools[{k}].input_schema must be a JSON schema object",
                               param="tools")  # fmt: skip
            function = {"name": tool["name"], "parameters": schema}
            if isinstance(tool.get("description"), str):
                function["description"] = tool["description"]
            functions.append({"type": "function", "function": function})
        fields["tools"] = functions
    if choice is None:
        return fields
    kind = choice.get("type")
    mapped: Any = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
    if kind == "tool":
        mapped = {"type": "function", "function": {"name": choice.get("name")}}
    if mapped is None:
        raise APIError(f"tool_choice type {kind!r} is not one of auto, any, tool, none",
                       param="tool_choice")  # fmt: skip
    fields["tool_choice"] = mapped
    if choice.get("disable_parallel_tool_use"):
        fields["parallel_tool_calls"] = False
    return fields


def thinking_budget(thinking: dict[str, Any] | None) -> int | None:
    """An enabled thinking's budget_tokens (None where thinking is not enabled)."""
    if thinking is None or thinking.get("type") != "enabled" or "budget_tokens" not in thinking:
        return None
    budget = thinking["budget_tokens"]
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise APIError(f"thinking.budget_tokens must be an integer >= 0, got {budget!r}",
                       param="thinking")  # fmt: skip
    return budget


def _thinking(thinking: dict[str, Any] | None) -> dict[str, Any]:
    """thinking on or off, as the chat template's enable_thinking (Qwen3's)."""
    if thinking is None:
        return {}
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled"):
        raise APIError(f"thinking type {kind!r} is not one of enabled, disabled",
                       param="thinking")  # fmt: skip
    return {"enable_thinking": kind == "enabled"}
