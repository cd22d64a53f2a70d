"""The server's HTTP routes: health and version, the models and their LoRA adapters,
completions and chat (a JSON body, or an SSE stream that aborts its requests however it
ends), the Responses API and its store, Anthropic's Messages API, a pooling model's
embeddings, scores and reranking, tokenize and detokenize, and Prometheus' /metrics. The
serving classes do the work; a route takes the request to one and its answer back."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from pyengine import __version__
from pyengine.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from pyengine.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pyengine.entrypoints.anthropic.serving_messages import MessagesServing
from pyengine.entrypoints.openai.errors import APIError
from pyengine.entrypoints.openai.metrics import EngineMetrics
from pyengine.entrypoints.openai.middlewares import Access, ApiKeyCheck
from pyengine.entrypoints.openai.pooling_protocol import (
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from pyengine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from pyengine.entrypoints.openai.responses_protocol import ResponsesRequest
from pyengine.entrypoints.openai.served_models import ServedModels, path_inside
from pyengine.entrypoints.openai.serving import SSE_DONE, close_all, sse, unless_disconnected
from pyengine.entrypoints.openai.serving_chat import ChatServing
from pyengine.entrypoints.openai.serving_completion import CompletionServing
from pyengine.entrypoints.openai.serving_pooling import PoolingServing
from pyengine.entrypoints.openai.serving_responses import ResponsesServing
from pyengine.entrypoints.openai.slow_clients import REQUEST_IDS
from pyengine.executor import ExecutorDeadError

logger = logging.getLogger("pyengine")

CLIENT_CLOSED = 499  # nginx's status for a client that went away before the answer


def runtime_lora_updating() -> bool:
    """Whether /v1/load_lora_adapter and /v1/unload_lora_adapter are served (as vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING): PYENGINE_ALLOW_RUNTIME_LORA_UPDATING=1 or true."""
    value = os.environ.get("PYENGINE_ALLOW_RUNTIME_LORA_UPDATING", "")
    return value.lower() in ("1", "true")


class Routes:
    """The routes over one engine, its served names and its serving classes. Each route
    is a method; `add_to` gives them to the app."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        served: ServedModels,
        completions: CompletionServing,
        chat: ChatServing,
        metrics: EngineMetrics | None,
        access: Access | None = None,
    ) -> None:
        self.engine = engine
        self.served = served
        self.completions = completions
        self.chat = chat
        self.messages = MessagesServing(chat)
        self.responses = ResponsesServing(chat)
        self.pooling = PoolingServing(engine, served, None, chat.waiting, chat.limits)
        self.metrics = metrics
        self.access = access or Access()
        self.created = int(time.time())  # (the model cards' creation time)

    def add_to(self, app: FastAPI) -> None:
        """Adds every route to the app, in the order it matches them (on the app itself,
        as its decorators would: an included APIRouter is matched through a wrapper of
        its own); the adapters' loading and unloading only with
        PYENGINE_ALLOW_RUNTIME_LORA_UPDATING and LoRA enabled, where an admin key and
        a LoRA root say who may, from where (ValueError otherwise)."""
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/version", self.version, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{name:path}", self.model, methods=["GET"])
        if runtime_lora_updating() and self.engine.config.lora is not None:
            if not self.access.admin_api_keys or self.access.lora_root is None:
                raise ValueError(
                    "PYENGINE_ALLOW_RUNTIME_LORA_UPDATING needs --admin-api-key (who may "
                    "load adapters) and --lora-root (where from)"
                )
            app.add_api_route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"])
            app.add_api_route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"])
        app.add_api_route("/v1/completions", self.create_completion, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.create_chat_completion, methods=["POST"])
        app.add_api_route("/v1/responses", self.create_response, methods=["POST"])
        app.add_api_route("/v1/responses/{response_id}", self.get_response, methods=["GET"])
        app.add_api_route("/v1/responses/{response_id}", self.delete_response,
                          methods=["DELETE"])  # fmt: skip
        app.add_api_route("/v1/messages", self.create_message, methods=["POST"])
        app.add_api_route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])
        app.add_api_route("/v1/embeddings", self.create_embeddings, methods=["POST"])
        for path in ("/score", "/v1/score"):
            app.add_api_route(path, self.create_score, methods=["POST"])
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            app.add_api_route(path, self.create_rerank, methods=["POST"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        app.add_api_route("/metrics", self.prometheus_metrics, methods=["GET"])

    async def health(self) -> Response:
        healthy = await asyncio.to_thread(self.engine.check_health)
        return Response(status_code=200 if healthy else 503)

    async def version(self) -> dict[str, str]:
        return {"version": __version__}

    def model_card(self, name: str) -> dict[str, Any]:
        _, adapter = self.served.resolve(name)
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "pyengine",
            "max_model_len": self.engine.config.max_model_len,
            "root": self.served.base_name if adapter is None else name,  # (no server path)
            "parent": None if adapter is None else self.served.base_name,
        }

    async def models(self) -> dict[str, Any]:
        names = [*self.served.base_names, *self.served.adapters]
        return {"object": "list", "data": [self.model_card(name) for name in names]}

    async def model(self, name: str) -> dict[str, Any]:
        return self.model_card(name)

    def admin(self, raw: Request) -> int:
        """The index of the admin key `raw` came with; 403 where it came with another."""
        index = raw.scope.get(ApiKeyCheck.KEY_INDEX)
        if index not in self.access.admin_indices:
            raise APIError("loading and unloading adapters needs an admin API key", status=403)
        return int(index)

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest, raw: Request) -> dict[str, str]:
        owner = self.admin(raw)
        path = path_inside(self.access.lora_root or "", body.lora_path)
        request = self.served.new_adapter(body.lora_name, path)
        try:
            await asyncio.to_thread(self.engine.llm_engine.adapters.check, request)
        except ValueError as error:
            raise APIError(str(error), param="lora_path") from None
        self.served.add(request, owner)
        logger.info("loaded LoRA adapter %s from %s", body.lora_name, path)
        return {"status": "ok", "lora_name": body.lora_name}

    async def unload_lora_adapter(
        self, body: UnloadLoRAAdapterRequest, raw: Request
    ) -> dict[str, str]:
        self.served.remove(body.lora_name, self.admin(raw))  # new requests no longer find it
        logger.info("unloaded LoRA adapter %s", body.lora_name)
        return {"status": "ok", "lora_name": body.lora_name}

    async def create_completion(self, body: CompletionRequest, raw: Request) -> Response:
        return await answer(raw, self.completions.create(with_key_salt(body, raw)))

    async def create_chat_completion(self, body: ChatCompletionRequest, raw: Request) -> Response:
        return await answer(raw, self.chat.create(with_key_salt(body, raw)))

    async def create_response(self, body: ResponsesRequest, raw: Request) -> Response:
        salt, owner = raw.scope.get(ApiKeyCheck.SALT), raw.scope.get(ApiKeyCheck.KEY_INDEX)
        return await answer(raw, self.responses.create(body, salt, owner))

    async def get_response(self, response_id: str, raw: Request) -> dict[str, Any]:
        return self.responses.get(response_id, raw.scope.get(ApiKeyCheck.KEY_INDEX))

    async def delete_response(self, response_id: str, raw: Request) -> dict[str, Any]:
        return self.responses.delete(response_id, raw.scope.get(ApiKeyCheck.KEY_INDEX))

    async def create_message(self, body: MessagesRequest, raw: Request) -> Response:
        salt = raw.scope.get(ApiKeyCheck.SALT)
        return await answer(raw, self.messages.create(body, salt))

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, Any]:
        return await self.messages.count_tokens(body)

    async def create_embeddings(self, body: EmbeddingRequest, raw: Request) -> Response:
        return await answer(raw, self.pooling.embeddings(body))

    async def create_score(self, body: ScoreRequest, raw: Request) -> Response:
        return await answer(raw, self.pooling.score(body))

    async def create_rerank(self, body: RerankRequest, raw: Request) -> Response:
        return await answer(raw, self.pooling.rerank(body))

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.completions.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            _, tokens = await self.chat.render(body.messages, None, body.add_generation_prompt)
        else:  # (off the event loop, as a completion's prompt)
            tokens = await asyncio.to_thread(
                self.chat.encode, body.prompt or "", "prompt", body.add_special_tokens
            )
        max_model_len = self.engine.config.max_model_len
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.completions.check_model(body.model)
        self.completions.check_token_ids(body.tokens, "tokens")
        max_model_len = self.engine.config.max_model_len
        if len(body.tokens) > max_model_len:
            raise APIError(
                f"{len(body.tokens)} tokens are more than max_model_len ({max_model_len})",
                param="tokens",
            )
        text = await asyncio.to_thread(self.chat.tokenizer.decode, body.tokens, False)
        return {"prompt": text}

    async def prometheus_metrics(self) -> Response:
        content = self.metrics.render() if self.metrics is not None else b""
        return Response(content, media_type=CONTENT_TYPE_LATEST)


RequestBody = TypeVar("RequestBody", CompletionRequest, ChatCompletionRequest)


def with_key_salt(body: RequestBody, raw: Request) -> RequestBody:
    """The body, its cache_salt the API key's where the server binds salts to keys."""
    salt = raw.scope.get(ApiKeyCheck.SALT)
    return body if salt is None else body.model_copy(update={"cache_salt": salt})


async def answer(raw: Request, work: Awaitable[Any]) -> Response:
    """A JSON body, or an SSE stream whose requests are aborted if it ends early."""
    try:
        result = await unless_disconnected(raw, work)
    except asyncio.CancelledError:
        return Response(status_code=CLIENT_CLOSED)
    if isinstance(result, dict):
        return JSONResponse(result)
    events, streams = result
    state = raw.scope.get("state")
    if state is not None:  # (for the log line, should the client stall)
        state[REQUEST_IDS] = [stream.request_id for stream in streams]
    return EngineStreamResponse(events, streams)


class EngineStreamResponse(StreamingResponse):
    """A stream of SSE events from engine requests, which are aborted however it ends: a
    client gone or stalled, a send that failed, or a stream that never started."""

    def __init__(self, events: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(_ending_in_an_error_event(events), media_type="text/event-stream")
        self.streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close_all(self.streams)  # (nothing to abort where they finished)


async def _ending_in_an_error_event(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream whose engine fails mid-way (a worker died) ends with the error as an
    event, then [DONE], as OpenAI's streams do: the client learns why it ended. So does
    one whose later work is refused (a beam search's later step, past the server's
    bound on waiting requests)."""
    try:
        async for event in events:
            yield event
    except APIError as error:
        yield sse(error.body())
        yield SSE_DONE
    except (EngineDeadError, ExecutorDeadError, RuntimeError) as error:
        logger.error("a stream ended by an engine failure: %s", error)
        yield sse(APIError(f"the engine failed: {error}", status=503).body())
        yield SSE_DONE
