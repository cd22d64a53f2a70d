"""The pooling endpoints of a server whose engine runs a pooling model (runner
"pooling"): /v1/embeddings (floats or base64), /v1/score and /v1/rerank. Each input is a
pooling request of the engine, batched with the others by the scheduler; a request's
inputs are admitted together, and none stays queued if one is refused.

A cross-encoder (a one-label classifier) scores a pair by reading both texts at once,
the second of token type 1; an embedder scores it by the cosine of their embeddings, each
distinct text embedded once."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable
from typing import Any

import numpy as np

from pyengine.engine.async_engine import RequestStream
from pyengine.entrypoints.openai.errors import APIError
from pyengine.entrypoints.openai.pooling_protocol import (
    MAX_INPUTS,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from pyengine.entrypoints.openai.serving import OpenAIServing, close_all, random_id
from pyengine.entrypoints.score_pairs import cosine, distinct_texts, score_pairs
from pyengine.outputs import PoolingRequestOutput
from pyengine.pooling_params import PoolingParams

# (a request's text or None, its token ids, their types where it is a text pair)
PoolingInput = tuple[str | None, list[int], list[int] | None]


class PoolingServing(OpenAIServing):
    async def embeddings(self, body: EmbeddingRequest) -> dict[str, Any]:
        name = self.check_model(body.model)
        params = self.params(body, "embed", dimensions=body.dimensions, normalize=body.normalize)
        inputs = await self.encode_inputs(body.input)
        outputs = await self.run(inputs, params, body.priority, "input")
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(out.outputs.data,
                                                                     body.encoding_format)}
            for i, out in enumerate(outputs)
        ]  # fmt: skip
        tokens = sum(len(ids) for _, ids, _ in inputs)
        return {
            "id": random_id("embd"), "object": "list", "created": int(time.time()),
            "model": name, "data": data, "usage": _usage(tokens),
        }  # fmt: skip

    async def score(self, body: ScoreRequest) -> dict[str, Any]:
        name = self.check_model(body.model)
        try:
            pairs = score_pairs(body.text_1, body.text_2)
        except ValueError as error:
            raise APIError(str(error), param="text_2") from None
        scores, tokens = await self.score_pairs(pairs, body)
        data = [{"object": "score", "index": i, "score": s} for i, s in enumerate(scores)]
        return {
            "id": random_id("score"), "object": "list", "created": int(time.time()),
            "model": name, "data": data, "usage": _usage(tokens),
        }  # fmt: skip

    async def rerank(self, body: RerankRequest) -> dict[str, Any]:
        name = self.check_model(body.model)
        if not body.documents:
            raise APIError("documents: give at least one document", param="documents")
        if body.top_n is not None and body.top_n < 0:
            raise APIError(f"top_n must be >= 0, got {body.top_n}", param="top_n")
        pairs = [(body.query, document) for document in body.documents]
        scores, tokens = await self.score_pairs(pairs, body)
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or None]
        results = [
            {"index": i, "relevance_score": scores[i],
             **({"document": {"text": body.documents[i]}} if body.return_documents else {})}
            for i in ranked
        ]  # fmt: skip
        return {
            "id": random_id("rerank"), "model": name, "results": results,
            "usage": {"total_tokens": tokens},
        }  # fmt: skip

    async def score_pairs(
        self, pairs: list[tuple[str, str]], body: ScoreRequest | RerankRequest
    ) -> tuple[list[float], int]:
        """Each pair's score, and the prompt tokens it took. (A 400 names the request's
        second texts: text_2, or a rerank's documents.)"""
        param = "documents" if isinstance(body, RerankRequest) else "text_2"
        if len(pairs) > MAX_INPUTS:
            raise APIError(f"{len(pairs)} pairs: at most {MAX_INPUTS}", param=param)
        pooler = self.engine.config.pooler
        if pooler is not None and pooler.task == "embed":
            texts = distinct_texts(pairs)
            inputs = [await self.encode_text(text, param) for text in texts]
            outputs = await self.run(inputs, self.params(body, "embed"), body.priority, param)
            embedding = {t: out.outputs.data for t, out in zip(texts, outputs, strict=True)}
            scores = [cosine(embedding[a], embedding[b]) for a, b in pairs]
            return scores, sum(len(ids) for _, ids, _ in inputs)
        processor = self.engine.input_processor
        try:
            encoded = [await asyncio.to_thread(processor.encode_pair, a, b) for a, b in pairs]
        except ValueError as error:
            raise APIError(str(error), param=param) from None
        inputs = [(None, ids, types) for ids, types in encoded]
        outputs = await self.run(inputs, self.params(body, "score"), body.priority, param)
        return [out.outputs.score for out in outputs], sum(len(ids) for ids, _ in encoded)

    def params(self, body: Any, task: str, **fields: Any) -> PoolingParams:
        try:
            return PoolingParams(task=task, truncate_prompt_tokens=body.truncate_prompt_tokens,
                                 **fields)  # fmt: skip
        except ValueError as error:
            param = next((f for f in ("dimensions", "truncate_prompt_tokens")
                          if str(error).startswith(f)), None)  # fmt: skip
            raise APIError(str(error), param=param) from None

    async def encode_text(self, text: str, param: str) -> PoolingInput:
        return text, await asyncio.to_thread(self.encode, text, param), None

    async def encode_inputs(self, value: Any) -> list[PoolingInput]:
        """An embeddings request's inputs: a text, texts, token ids, or lists of them."""
        if isinstance(value, str):
            value = [value]
        if not value:
            raise APIError("input: give at least one text or token list", param="input")
        if all(isinstance(v, int) for v in value):
            value = [value]
        if len(value) > MAX_INPUTS:
            raise APIError(f"{len(value)} inputs: at most {MAX_INPUTS}", param="input")
        inputs: list[PoolingInput] = []
        for item in value:
            if isinstance(item, str):
                inputs.append(await self.encode_text(item, "input"))
                continue
            if not item:
                raise APIError("input: a token list is empty", param="input")
            self.check_token_ids(item, "input")
            inputs.append((None, list(item), None))
        return inputs

    async def run(
        self, inputs: list[PoolingInput], params: PoolingParams, priority: int, param: str
    ) -> list[PoolingRequestOutput]:
        """Runs the inputs as pooling requests; their outputs in order. A request the
        engine refuses is a 400 naming `param` (the inputs' field), or the field its
        error names."""
        request_id = random_id("pool")

        def add(i: int) -> Awaitable[RequestStream]:
            text, ids, types = inputs[i]
            return self.engine.add_pooling_request(
                f"{request_id}-{i}", ids, params, text, types, priority
            )

        lengths = [len(ids) for _, ids, _ in inputs]
        streams = await self.queue_all(lengths, 1, add, ("dimensions", "priority"), param)
        try:
            return list(await asyncio.gather(*(_only_output(s) for s in streams)))
        finally:  # (a client gone, or an output missing: the others are aborted)
            close_all(streams)


async def _only_output(stream: RequestStream) -> PoolingRequestOutput:
    async for out in stream:
        if isinstance(out, PoolingRequestOutput) and out.outputs.data:
            return out
    raise APIError("the request was aborted before its output", status=500)


def _encoded(data: list[float], encoding_format: str) -> list[float] | str:
    """An embedding as floats, or as base64 of its little-endian float32 bytes (what
    OpenAI's clients decode)."""
    if encoding_format == "float":
        return data
    return base64.b64encode(np.asarray(data, dtype="<f4").tobytes()).decode()


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens}
