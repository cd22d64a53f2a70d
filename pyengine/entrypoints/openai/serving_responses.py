"""POST /v1/responses (and GET and DELETE /v1/responses/{id} where `store` kept one): a
Responses request run as the chat completion it asks for (responses_protocol.py), its
answer as a response object whose output items are a reasoning item (where the server
has a reasoning parser), the message (its output_text) and the function calls. A stored
response keeps its conversation, in a bounded store (the oldest goes first), so that a
request naming it as `previous_response_id` goes on from it. Streamed, the chat's chunks
become the Responses API's events: response.created and response.in_progress, then for
each item output_item.added, its deltas (output_text, reasoning_text,
function_call_arguments) and their done events, output_item.done, and last
response.completed (or response.incomplete where max_output_tokens cut it)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from pyengine.engine.async_engine import EngineDeadError, RequestStream
from pyengine.entrypoints.openai.errors import APIError
from pyengine.entrypoints.openai.responses_protocol import ResponsesRequest
from pyengine.entrypoints.openai.serving_chat import ChatRun, ChatServing, delta_pieces
from pyengine.executor import ExecutorDeadError

logger = logging.getLogger("pyengine")

STORED_RESPONSES = 1000  # responses kept for previous_response_id and GET, newest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseStore:
    """Stored responses and their conversations (chat messages, this turn's answer
    included), each readable by the API key that made it alone (`owner`: its index, None
    on a server without keys), the oldest dropped past `capacity`."""

    def __init__(self, capacity: int = STORED_RESPONSES) -> None:
        self.capacity = capacity
        self.items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], Any]] = (
            OrderedDict()
        )

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]], owner: Any) -> None:
        self.items[response["id"]] = (response, conversation, owner)
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def get(self, response_id: str, owner: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        found = self.items.get(response_id)
        if found is None or found[2] != owner:  # (another key's is not found either)
            raise APIError(f"no stored response has id {response_id!r}", status=404)
        return found[0], found[1]

    def delete(self, response_id: str, owner: Any) -> None:
        self.get(response_id, owner)
        del self.items[response_id]


class Output:
    """A response's output items, built from a whole answer or a stream's deltas."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def reasoning(self, text: str) -> dict[str, Any]:
        item = {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "completed",
                "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip
        self.items.append(item)
        return item

    def message(self, text: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = {"type": "message", "id": _id("msg"), "status": "completed", "role": "assistant",
                "content": [part]}  # fmt: skip
        self.items.append(item)
        return item

    def call(self, call_id: str, name: str, arguments: str) -> dict[str, Any]:
        item = {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name,
                "arguments": arguments, "status": "completed"}  # fmt: skip
        self.items.append(item)
        return item

    def answer(self) -> dict[str, Any]:
        """The output as the chat message a later turn replays."""
        text = "".join(p["text"] for i in self.items if i["type"] == "message"
                       for p in i["content"])  # fmt: skip
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]  # fmt: skip
        return {"role": "assistant", "content": text or None,
                **({"tool_calls": calls} if calls else {})}  # fmt: skip


def response_usage(usage: dict[str, Any]) -> dict[str, Any]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}  # fmt: skip


class ResponsesServing:
    """The Responses API over the server's chat completions, with its store."""

    def __init__(self, chat: ChatServing, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store or ResponseStore()

    def get(self, response_id: str, owner: Any = None) -> dict[str, Any]:
        return self.store.get(response_id, owner)[0]

    def delete(self, response_id: str, owner: Any = None) -> dict[str, Any]:
        self.store.delete(response_id, owner)
        return {"id": response_id, "object": "response", "deleted": True}

    async def create(
        self, request: ResponsesRequest, cache_salt: str | None = None, owner: Any = None
    ) -> dict[str, Any] | tuple[AsyncIterator[str], list[RequestStream]]:
        """`cache_salt`: the API key's, where the server binds salts to keys; `owner`: the
        key's index, whose stored responses this one may go on from."""
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            try:
                history = list(self.store.get(request.previous_response_id, owner)[1])
            except APIError:
                raise APIError(
                    f"previous_response_id {request.previous_response_id!r} names no stored "
                    "response", param="previous_response_id",
                ) from None  # fmt: skip
        chat = request.to_chat(history)
        if cache_salt is not None:
            chat = chat.model_copy(update={"cache_salt": cache_salt})
        effort = request.effort()
        if effort is not None and self.chat.reasoning_parser is not None:
            chat = chat.model_copy(update={"reasoning_effort": effort})
        run = await self.chat.start_chat(chat)
        conversation = [*history, *request.turn_messages()]
        if request.stream:
            return self._events(request, run, conversation, owner), run.streams
        completion = await self.chat.whole(run)
        return await asyncio.to_thread(self._whole, request, completion, conversation, owner)

    def _whole(
        self, request: ResponsesRequest, completion: dict[str, Any],
        conversation: list[dict[str, Any]], owner: Any,
    ) -> dict[str, Any]:  # fmt: skip
        choice = completion["choices"][0]
        answer, output = choice["message"], Output()
        if answer.get("reasoning_content"):
            output.reasoning(answer["reasoning_content"])
        if answer.get("content"):
            output.message(answer["content"])
        for call in answer.get("tool_calls") or []:
            output.call(call["id"], call["function"]["name"], call["function"]["arguments"])
        response = self._response(request, _id("resp"), completion["created"], output.items)
        self._finish(response, choice["finish_reason"], completion["usage"])
        if request.store:
            self.store.put(response, [*conversation, output.answer()], owner)
        return response

    def _response(
        self, request: ResponsesRequest, response_id: str, created: int,
        output: list[dict[str, Any]],
    ) -> dict[str, Any]:  # fmt: skip
        return {
            "id": response_id, "object": "response", "created_at": created,
            "status": "in_progress", "model": request.model or self.chat.served.base_name,
            "output": output, "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "previous_response_id": request.previous_response_id,
            "tools": request.tools or [], "tool_choice": request.tool_choice or "auto",
            "text": request.text or {"format": {"type": "text"}},
            "temperature": request.temperature, "top_p": request.top_p,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "metadata": request.metadata or {}, "store": request.store,
            "truncation": "disabled", "error": None, "incomplete_details": None, "usage": None,
        }  # fmt: skip

    @staticmethod
    def _finish(response: dict[str, Any], finish: str | None, usage: dict[str, Any]) -> None:
        cut = finish == "length"
        response["status"] = "incomplete" if cut else "completed"
        response["incomplete_details"] = {"reason": "max_output_tokens"} if cut else None
        response["usage"] = response_usage(usage)

    async def _events(
        self, request: ResponsesRequest, run: ChatRun, conversation: list[dict[str, Any]],
        owner: Any,
    ) -> AsyncIterator[str]:  # fmt: skip
        events = EventStream()
        response = self._response(request, _id("resp"), int(time.time()), [])
        yield events.emit("response.created", response=dict(response))
        yield events.emit("response.in_progress", response=dict(response))
        items, finish, usage = StreamedItems(events), None, None
        try:
            async for chunk in self.chat.chunks(run):
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    for e in items.feed(choice["delta"]):
                        yield e
                    finish = choice.get("finish_reason") or finish
        except (EngineDeadError, ExecutorDeadError, RuntimeError) as error:
            logger.error("a stream ended by an engine failure: %s", error)
            yield events.emit("error", code="engine_failed", param=None,
                              message=f"the engine failed: {error}")  # fmt: skip
            return
        for e in items.close():
            yield e
        response["output"] = items.output.items
        self._finish(
            response,
            finish,
            usage
            or {"prompt_tokens": len(run.prompt[1]), "completion_tokens": 0, "total_tokens": 0},
        )
        if request.store:
            self.store.put(response, [*conversation, items.output.answer()], owner)
        done = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield events.emit(done, response=response)


class EventStream:
    """The stream's events, numbered in order (sequence_number)."""

    def __init__(self) -> None:
        self.sequence = 0

    def emit(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class StreamedItems:
    """A streamed response's output items, opened and closed as the chat's deltas change
    kind (reasoning, content, each tool call), each with its events."""

    def __init__(self, events: EventStream) -> None:
        self.events = events
        self.output = Output()
        self.open: str | None = None  # "reasoning", "message", or a call's "call:<k>"
        self.text = ""  # the open item's text (or arguments) so far

    def feed(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        for piece in delta_pieces(delta):
            if piece.kind == "reasoning":
                out += self._into("reasoning", lambda: self.output.reasoning(""))
                out.append(self._delta("response.reasoning_text.delta", piece.text))
            elif piece.kind == "content":
                out += self._into("message", lambda: self.output.message(""))
                out.append(self._delta("response.output_text.delta", piece.text))
            elif piece.kind == "call":
                make = functools.partial(self.output.call, piece.call_id, piece.name, "")
                out += self._into(f"call:{piece.call_index}", make)
            else:
                out.append(self._delta("response.function_call_arguments.delta", piece.text))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        item, index = self.output.items[-1], len(self.output.items) - 1
        at = {"item_id": item["id"], "output_index": index}
        out = []
        if item["type"] == "function_call":
            item["arguments"] = self.text
            out.append(self.events.emit("response.function_call_arguments.done", **at,
                                        name=item["name"], arguments=self.text))  # fmt: skip
        else:
            part = item["content"][0]
            part["text"] = self.text
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            extra: dict[str, Any] = {"logprobs": []} if kind == "output_text" else {}
            out.append(self.events.emit(f"response.{kind}.done", **at, content_index=0,
                                        text=self.text, **extra))  # fmt: skip
            out.append(self.events.emit("response.content_part.done", **at, content_index=0,
                                        part=part))  # fmt: skip
        item["status"] = "completed"
        out.append(self.events.emit("response.output_item.done", output_index=index, item=item))
        self.open, self.text = None, ""
        return out

    def _into(self, kind: str, make: Any) -> list[str]:
        if self.open == kind:
            return []
        out = self.close()
        item = make()
        index = len(self.output.items) - 1
        added = {**item, "status": "in_progress"}
        if item["type"] != "function_call":
            added["content"] = []
        out.append(self.events.emit("response.output_item.added", output_index=index, item=added))
        if item["type"] != "function_call":
            out.append(self.events.emit("response.content_part.added", item_id=item["id"],
                                        output_index=index, content_index=0,
                                        part=item["content"][0]))  # fmt: skip
        self.open = kind
        return out

    def _delta(self, kind: str, text: str) -> str:
        self.text += text
        item, index = self.output.items[-1], len(self.output.items) - 1
        fields: dict[str, Any] = {"item_id": item["id"], "output_index": index, "delta": text}
        if kind != "response.function_call_arguments.delta":
            fields["content_index"] = 0
        if kind == "response.output_text.delta":
            fields["logprobs"] = []
        return self.events.emit(kind, **fields)
