"""POST /v1/messages and /v1/messages/count_tokens: a Messages request run as the chat
completion it asks for (protocol.py), its answer as Anthropic's message: content blocks
(thinking where the server has a reasoning parser, text, tool_use with its input
parsed), the stop reason (end_turn, max_tokens, stop_sequence with the sequence, or
tool_use) and the usage. Streamed, the chat's chunks become Anthropic's events:
message_start, then for each block content_block_start, its deltas (thinking_delta,
text_delta, input_json_delta) and content_block_stop, then message_delta with the stop
reason and the output tokens, and message_stop; an engine that fails mid-way ends the
stream with an error event."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from pyengine.engine.async_engine import EngineDeadError, RequestStream
from pyengine.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    thinking_budget,
)
from pyengine.entrypoints.openai.errors import APIError
from pyengine.entrypoints.openai.serving_chat import ChatRun, ChatServing, delta_pieces
from pyengine.executor import ExecutorDeadError

logger = logging.getLogger("pyengine")


def event(name: str, payload: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def stop_of(
    finish: str | None, matched: Any, sequences: list[str] | None, called: bool
) -> tuple[str, Any]:
    """(stop_reason, stop_sequence) of a chat choice's finish and what stopped it; a
    message with tool calls (`called`: a forced call's too, which chat finishes "stop")
    stopped to use them."""
    if called or finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "stop" and isinstance(matched, str) and matched in (sequences or []):
        return "stop_sequence", matched
    return "end_turn", None


def message_usage(usage: dict[str, Any]) -> dict[str, Any]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}  # fmt: skip


def message_of(completion: dict[str, Any], sequences: list[str] | None) -> dict[str, Any]:
    """A chat.completion object as Anthropic's message."""
    choice = completion["choices"][0]
    answer = choice["message"]
    content: list[dict[str, Any]] = []
    if answer.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": answer["reasoning_content"],
                        "signature": ""})  # fmt: skip
    if answer.get("content"):
        content.append({"type": "text", "text": answer["content"]})
    for call in answer.get("tool_calls") or []:
        function = call["function"]
        content.append({"type": "tool_use", "id": call["id"], "name": function["name"],
                        "input": json.loads(function["arguments"])})  # fmt: skip
    stop_reason, stop_sequence = stop_of(choice["finish_reason"], choice.get("stop_reason"),
                                         sequences, bool(answer.get("tool_calls")))  # fmt: skip
    return {
        "id": completion["id"].replace("chatcmpl-", "msg_", 1),
        "type": "message",
        "role": "assistant",
        "model": completion["model"],
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": message_usage(completion["usage"]),
    }


class Blocks:
    """A streamed message's content blocks, opened and closed as the chat's deltas
    change kind (reasoning, content, each tool call), numbered in order."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking", "text", or a tool call's "tool:<k>"
        self.called = False  # (a tool_use block was opened)

    def feed(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        for piece in delta_pieces(delta):
            if piece.kind == "reasoning":
                thinking = {"type": "thinking", "thinking": "", "signature": ""}
                events += self._into("thinking", thinking)
                events.append(self._delta({"type": "thinking_delta", "thinking": piece.text}))
            elif piece.kind == "content":
                events += self._into("text", {"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": piece.text}))
            elif piece.kind == "call":
                call = {"type": "tool_use", "id": piece.call_id, "name": piece.name, "input": {}}
                events += self._into(f"tool:{piece.call_index}", call)
                self.called = True
            else:
                events.append(self._delta({"type": "input_json_delta", "partial_json": piece.text}))
        return events

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _into(self, kind: str, block: dict[str, Any]) -> list[str]:
        if self.open == kind:
            return []
        events = self.close()
        self.index += 1
        self.open = kind
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*events, event("content_block_start", start)]

    def _delta(self, delta: dict[str, Any]) -> str:
        payload = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return event("content_block_delta", payload)


class MessagesServing:
    """The Messages API over the server's chat completions."""

    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def create(
        self, request: MessagesRequest, cache_salt: str | None = None
    ) -> dict[str, Any] | tuple[AsyncIterator[str], list[RequestStream]]:
        """`cache_salt`: the API key's, where the server binds salts to keys."""
        sampling: dict[str, Any] = {} if cache_salt is None else {"cache_salt": cache_salt}
        budget = thinking_budget(request.thinking)
        if budget is not None and self.chat.reasoning_parser is not None:
            sampling["max_thinking_tokens"] = budget  # (where the server knows the end)
        run = await self.chat.start_chat(request.to_chat(**sampling))
        if request.stream:
            return self._events(request, run), run.streams
        return message_of(await self.chat.whole(run), request.stop_sequences)

    async def count_tokens(self, request: CountTokensRequest) -> dict[str, Any]:
        chat = request.to_chat()
        self.chat.check_model(chat.model)
        tools = await self.chat.tool_choice(chat, with_grammar=False)  # (nothing is generated)
        _, tokens = await self.chat.prompt_of(chat, tools)
        return {"input_tokens": len(tokens)}

    async def _events(self, request: MessagesRequest, run: ChatRun) -> AsyncIterator[str]:
        start: dict[str, Any] = {
            "id": run.request_id.replace("chatcmpl-", "msg_", 1), "type": "message",
            "role": "assistant", "model": run.model, "content": [], "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(run.prompt[1]), "output_tokens": 0},
        }  # fmt: skip
        yield event("message_start", {"type": "message_start", "message": start})
        blocks, finish, matched, output_tokens = Blocks(), None, None, 0
        try:
            async for chunk in self.chat.chunks(run):
                if chunk.get("usage"):
                    output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    for e in blocks.feed(choice["delta"]):
                        yield e
                    if choice.get("finish_reason") is not None:
                        finish, matched = choice["finish_reason"], choice.get("stop_reason")
        except (EngineDeadError, ExecutorDeadError, RuntimeError) as error:
            logger.error("a stream ended by an engine failure: %s", error)
            failure = APIError(f"the engine failed: {error}", status=503)
            yield event("error", failure.anthropic_body())
            return
        for e in blocks.close():
            yield e
        stop_reason, stop_sequence = stop_of(finish, matched, request.stop_sequences,
                                             blocks.called)  # fmt: skip
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        yield event("message_delta", {"type": "message_delta", "delta": delta,
                                      "usage": {"output_tokens": output_tokens}})  # fmt: skip
        yield event("message_stop", {"type": "message_stop"})
