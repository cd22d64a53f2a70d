"""Adapters through the OpenAI-compatible server, driven by the official openai client:
the request's `model` chooses the base model or an adapter (--lora-modules), each
answering as the offline LLM with that adapter; /v1/models lists the adapters with their
parent; an unknown model is a 404; with PYENGINE_ALLOW_RUNTIME_LORA_UPDATING=1 adapters
load and unload at run time, with an admin key, from inside --lora-root, each unloaded
only by the key that loaded it, a bad one refused while the server keeps serving."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from helpers.lora import write_random_adapter
from helpers.server import Server, openai_client, serving

from pyengine import LLM, LoRARequest, SamplingParams
from pyengine.loader.resolve import DEFAULT_MODEL, load_model

MAX_MODEL_LEN, KV_CACHE_BYTES = 512, 64 * 2**20
PROMPT = "The capital of France is"
ADMIN_KEY, OTHER_ADMIN_KEY = "admin-key", "other-admin-key"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    config = load_model(DEFAULT_MODEL, read_weights=False).config
    folders = {name: root / name for name in ("sql", "chat", "late")}
    for seed, folder in enumerate(folders.values()):
        write_random_adapter(config, folder, seed)
    return folders


@pytest.fixture(scope="module")
def server(adapters: dict[str, Path]) -> Iterator[Server]:
    extra = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
             "--lora-modules", f"sql={adapters['sql']}", f"chat={adapters['chat']}",
             "--admin-api-key", ADMIN_KEY, "--admin-api-key", OTHER_ADMIN_KEY,
             "--lora-root", str(adapters["late"].parent), "--max-lora-adapters", "3"]  # fmt: skip
    yield from serving(DEFAULT_MODEL, MAX_MODEL_LEN, KV_CACHE_BYTES, extra,
                       env={"PYENGINE_ALLOW_RUNTIME_LORA_UPDATING": "1"})  # fmt: skip


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def offline(adapters: dict[str, Path]) -> Iterator[tuple[LLM, dict[str, LoRARequest]]]:
    llm = LLM(DEFAULT_MODEL, max_model_len=MAX_MODEL_LEN, kv_cache_memory=KV_CACHE_BYTES,
              enable_lora=True, max_loras=2, max_lora_rank=8)  # fmt: skip
    requests = {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())}
    yield llm, requests
    llm.llm_engine.shutdown()


def offline_text(offline: tuple[LLM, dict[str, LoRARequest]], name: str | None) -> str:
    llm, requests = offline
    params = SamplingParams(temperature=0, max_tokens=12)
    lora = None if name is None else requests[name]
    return llm.generate([PROMPT], params, use_tqdm=False, lora_request=lora)[0].outputs[0].text


def completion(client: openai.OpenAI, model: str) -> str:
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.model == model
    return got.choices[0].text


def test_the_model_field_chooses_the_adapter(client: openai.OpenAI, offline) -> None:  # type: ignore[no-untyped-def]
    cards = {m.id: m for m in client.models.list()}
    assert list(cards) == [DEFAULT_MODEL, "sql", "chat"]
    assert cards["sql"].parent == DEFAULT_MODEL and cards[DEFAULT_MODEL].parent is None  # type: ignore[attr-defined]
    texts = {name: completion(client, name) for name in (DEFAULT_MODEL, "sql", "chat")}
    assert texts[DEFAULT_MODEL] == offline_text(offline, None)
    assert texts["sql"] == offline_text(offline, "sql")
    assert texts["chat"] == offline_text(offline, "chat")
    assert len(set(texts.values())) == 3  # each adapter changes the answer
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        completion(client, "nope")


def test_metrics_name_the_adapters(server: Server, client: openai.OpenAI) -> None:
    completion(client, "sql")
    status, text = server.request("GET", "/metrics")
    assert status == 200
    assert 'pyengine:lora_requests_info{max_lora="2",running_lora_adapters="' in text


def test_a_streamed_chat_through_an_adapter(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model="chat", messages=messages, max_tokens=10,
                                           temperature=0)  # fmt: skip
    stream = client.chat.completions.create(model="chat", messages=messages, max_tokens=10,
                                            temperature=0, stream=True)  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content and whole.model == "chat"


def test_adapters_load_and_unload_at_run_time(
    server: Server,
    client: openai.OpenAI,
    adapters: dict[str, Path],
    offline,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    body = '{"lora_name": "late", "lora_path": "late"}'  # (inside the root)
    status, answer = server.request("POST", "/v1/load_lora_adapter", body)
    assert status == 403 and "admin" in answer["error"]["message"]  # a tenant's key
    status, answer = server.request("POST", "/v1/load_lora_adapter", body, auth=ADMIN_KEY)
    assert status == 200, answer
    assert completion(client, "late") == offline_text(offline, "late")
    cards = {m.id: m for m in client.models.list()}
    assert "late" in cards and str(adapters["late"]) not in str(cards["late"])
    status, answer = server.request("POST", "/v1/load_lora_adapter", body, auth=ADMIN_KEY)
    assert status == 400 and "already served" in answer["error"]["message"]
    unload = '{"lora_name": "late"}'
    status, answer = server.request("POST", "/v1/unload_lora_adapter", unload,
                                    auth=OTHER_ADMIN_KEY)  # fmt: skip
    assert status == 403 and "another API key" in answer["error"]["message"]
    status, _ = server.request("POST", "/v1/unload_lora_adapter", unload, auth=ADMIN_KEY)
    assert status == 200
    with pytest.raises(openai.NotFoundError):
        completion(client, "late")
    status, _ = server.request("POST", "/v1/unload_lora_adapter", unload, auth=ADMIN_KEY)
    assert status == 404
    assert completion(client, "sql") == offline_text(offline, "sql")  # still serving


def test_paths_outside_the_root_are_refused_alike(
    server: Server, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """A path outside --lora-root (absolute, climbing out, or a link pointing out) gets
    one message whatever is there: an adapter, another file, or nothing."""
    outside = tmp_path / "outside"
    write_random_adapter(load_model(DEFAULT_MODEL, read_weights=False).config, outside, 7)
    link = adapters["late"].parent / "link-out"
    link.symlink_to(outside)
    messages = set()
    for path in (outside, tmp_path / "missing", "/etc/passwd", "../outside", "link-out"):
        body = json.dumps({"lora_name": "out", "lora_path": str(path)})
        status, answer = server.request("POST", "/v1/load_lora_adapter", body, auth=ADMIN_KEY)
        assert status == 400 and answer["error"]["param"] == "lora_path", answer
        messages.add(answer["error"]["message"])
    assert len(messages) == 1 and "--lora-root" in messages.pop()
    status, answer = server.request("POST", "/v1/load_lora_adapter",
                                    '{"lora_name": "bad", "lora_path": "missing"}',
                                    auth=ADMIN_KEY)  # fmt: skip
    assert status == 400 and "does not exist" in answer["error"]["message"]  # (inside)


def test_the_adapter_count_is_bounded(server: Server) -> None:
    """--max-lora-adapters 3: the two of the command line and one more."""
    load = '{{"lora_name": "{}", "lora_path": "late"}}'
    status, answer = server.request("POST", "/v1/load_lora_adapter", load.format("one"),
                                    auth=ADMIN_KEY)  # fmt: skip
    assert status == 200, answer
    status, answer = server.request("POST", "/v1/load_lora_adapter", load.format("two"),
                                    auth=ADMIN_KEY)  # fmt: skip
    assert status == 400 and "--max-lora-adapters" in answer["error"]["message"]
    status, _ = server.request("POST", "/v1/unload_lora_adapter", '{"lora_name": "one"}',
                               auth=ADMIN_KEY)  # fmt: skip
    assert status == 200


def test_an_adapter_whose_files_vanished_fails_alone(
    server: Server,
    client: openai.OpenAI,
    adapters: dict[str, Path],
    offline,  # type: ignore[no-untyped-def]
) -> None:
    """An adapter checked at loading whose files are gone by its first step: that step
    fails for its request alone, which gets the adapter's error; the step runs again
    without it, so that a request running beside it goes on token for token as the
    offline engine's, and the engine keeps serving."""
    folder = adapters["late"].parent / "vanishing"
    shutil.copytree(adapters["late"], folder)
    load = '{"lora_name": "vanishing", "lora_path": "vanishing"}'
    assert server.request("POST", "/v1/load_lora_adapter", load, auth=ADMIN_KEY)[0] == 200
    shutil.rmtree(folder)
    llm, _ = offline
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].text
    stream = client.completions.create(
        model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    text = next(chunks).choices[0].text  # (it runs)
    status, answer = server.request("POST", "/v1/completions", json.dumps(
        {"model": "vanishing", "prompt": PROMPT, "max_tokens": 4}))  # fmt: skip
    assert status == 500 and "vanishing" in answer["error"]["message"], answer
    text += "".join(chunk.choices[0].text for chunk in chunks)
    assert text == expected
    assert server.request("GET", "/health", auth=False)[0] == 200
    assert completion(client, "sql") == offline_text(offline, "sql")
    server.request("POST", "/v1/unload_lora_adapter", '{"lora_name": "vanishing"}', auth=ADMIN_KEY)
