"""The pooling endpoints end to end, against the server run as a user runs it with tiny
random checkpoints made in the test: /v1/embeddings through the official openai client
(floats and base64, dimensions, token ids) equal LLM.embed's numbers; /v1/score and
/v1/rerank of a cross-encoder equal LLM.score's, and of an embedder the cosine of
embeddings; bad input is a 400 naming its field, and a generating server refuses
pooling requests (and a pooling server completions) by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from helpers.server import Server, openai_client, serving
from helpers.tiny_pooling import make_pooling_checkpoint

from pyengine import LLM
from pyengine.pooling_params import PoolingParams

pytest.importorskip("transformers")

TEXTS = ["w1 w2 w3", "w40", "w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory) -> Iterator[tuple[Server, Path]]:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp("bert")
    make_pooling_checkpoint("bert", folder)
    for server in serving(str(folder), max_model_len=64, extra=["--dtype", "float32"]):
        yield server, folder


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> Iterator[tuple[Server, Path]]:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp("bert-cross")
    make_pooling_checkpoint("bert-cross", folder)
    for server in serving(str(folder), max_model_len=64, extra=["--dtype", "float32"]):
        yield server, folder


def _llm(folder: Path) -> LLM:
    return LLM(str(folder), dtype="float32", kv_cache_memory=2**24)


def _post(server: Server, path: str, body: dict[str, object]) -> tuple[int, dict]:  # type: ignore[type-arg]
    status, answer = server.request("POST", path, json.dumps(body))
    return status, answer


def test_embeddings_through_the_openai_client(embedder) -> None:  # type: ignore[no-untyped-def]
    server, folder = embedder
    client = openai_client(server)
    expected = [o.outputs.embedding for o in _llm(folder).embed(TEXTS, use_tqdm=False)]
    floats = client.embeddings.create(model=str(folder), input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2]
    for data, theirs in zip(floats.data, expected, strict=True):
        assert np.abs(np.subtract(data.embedding, theirs)).max() < 1e-6
    # (the client asks for base64 by default and decodes it)
    decoded = client.embeddings.create(model=str(folder), input=TEXTS[0])
    assert np.abs(np.subtract(decoded.data[0].embedding, expected[0])).max() < 1e-6
    assert floats.usage.prompt_tokens == sum(len(t.split()) + 2 for t in TEXTS)
    cut = client.embeddings.create(model=str(folder), input=[[2, 7, 8, 3]], dimensions=8,
                                   encoding_format="float")  # fmt: skip
    ours = _llm(folder).embed({"prompt_token_ids": [2, 7, 8, 3]}, PoolingParams(dimensions=8),
                              use_tqdm=False)  # fmt: skip
    assert np.abs(np.subtract(cut.data[0].embedding, ours[0].outputs.embedding)).max() < 1e-6


def test_an_embedder_scores_and_reranks_by_cosine(embedder) -> None:  # type: ignore[no-untyped-def]
    server, folder = embedder
    embedding = dict(zip(TEXTS, (np.array(o.outputs.embedding) for o in _llm(folder).embed(
        TEXTS, use_tqdm=False)), strict=True))  # fmt: skip
    status, answer = _post(server, "/v1/score", {"text_1": TEXTS[0], "text_2": TEXTS})
    assert status == 200, answer
    for item, text in zip(answer["data"], TEXTS, strict=True):
        assert abs(item["score"] - float(embedding[TEXTS[0]] @ embedding[text])) < 1e-6
    status, answer = _post(server, "/v1/rerank", {"query": TEXTS[0], "documents": TEXTS[1:]})
    assert status == 200, answer
    assert answer["results"][0]["relevance_score"] >= answer["results"][1]["relevance_score"]


def test_a_cross_encoder_scores_and_reranks_pairs(cross_encoder) -> None:  # type: ignore[no-untyped-def]
    server, folder = cross_encoder
    expected = [o.outputs.score for o in _llm(folder).score(TEXTS[0], TEXTS, use_tqdm=False)]
    status, answer = _post(server, "/v1/score", {"text_1": TEXTS[0], "text_2": TEXTS})
    assert status == 200, answer
    assert [d["index"] for d in answer["data"]] == [0, 1, 2]
    assert np.abs(np.subtract([d["score"] for d in answer["data"]], expected)).max() < 1e-6
    status, answer = _post(server, "/rerank", {"query": TEXTS[0], "documents": TEXTS, "top_n": 2})
    assert status == 200, answer
    best = sorted(range(3), key=lambda i: -expected[i])[:2]
    assert [r["index"] for r in answer["results"]] == best
    assert answer["results"][0]["document"] == {"text": TEXTS[best[0]]}
    assert abs(answer["results"][0]["relevance_score"] - expected[best[0]]) < 1e-6


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/embeddings", {"input": []}, "input", "at least one"),
        ("/v1/embeddings", {"input": [[2, 500]]}, "input", "outside the vocabulary"),
        ("/v1/embeddings", {"input": "w1", "dimensions": 0}, "dimensions", "positive"),
        ("/v1/embeddings", {"input": "w1", "dimensions": 65}, "dimensions", "embedding size"),
        ("/v1/embeddings", {"input": [[7] * 65]}, "input", "max_model_len is 64"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", "as many"),
        ("/v1/rerank", {"query": "w1", "documents": []}, "documents", "at least one"),
        ("/v1/embeddings", {"input": "w1", "priority": 3}, "priority", "scheduling_policy"),
    ],
)
def test_bad_pooling_requests_are_400s(embedder, path, body, param, message) -> None:  # type: ignore[no-untyped-def]
    server, _ = embedder
    status, answer = _post(server, path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param
    assert message in answer["error"]["message"]
    left = server.idle_metrics()  # (nothing left running or waiting)
    assert not [k for k, v in left.items() if k.startswith("num_requests_") and v]


def test_a_pooling_server_refuses_completions(embedder) -> None:  # type: ignore[no-untyped-def]
    server, folder = embedder
    with pytest.raises(openai.BadRequestError, match="generates no text"):
        openai_client(server).completions.create(model=str(folder), prompt="w1", max_tokens=2)


def test_a_cross_encoder_does_not_embed(cross_encoder) -> None:  # type: ignore[no-untyped-def]
    server, _ = cross_encoder
    status, answer = _post(server, "/v1/embeddings", {"input": "w1"})
    assert status == 400 and "does not embed" in answer["error"]["message"]
