"""The request bodies of the pooling endpoints: OpenAI's /v1/embeddings, and vLLM's
/v1/score (pairs of texts) and /v1/rerank (Jina's and Cohere's shape: a query and its
documents). Fields a client may send that pyengine does not use are accepted and
ignored, as for the other endpoints."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

# At most this many inputs in one request (OpenAI's bound on an embeddings request)
MAX_INPUTS = 2048


class _PoolingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    user: str | None = None
    # vLLM's extras: each text's first this many tokens; the queue's priority
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class EmbeddingRequest(_PoolingRequest):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None  # (vLLM's extra; None: the server's pooler_config, yes)


class ScoreRequest(_PoolingRequest):
    """text_1 scored against each of text_2 (one text), or side by side (as many)."""

    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_PoolingRequest):
    """The documents ranked by their relevance to the query, best first; top_n of them
    (None or 0: all)."""

    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True
