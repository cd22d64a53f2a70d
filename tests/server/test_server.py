"""The OpenAI-compatible server, run as a user runs it (`python -m
pyengine.entrypoints.openai.api_server`), on 127.0.0.1, driven by the official openai
client and by raw HTTP for what a client library would not send."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.metadata import entry_points
from typing import Any

import openai
import pytest
from helpers.server import API_KEY, OUTSIDE_SOURCE_TREE, Server, openai_client, serving

from pyengine import LLM, SamplingParams
from pyengine.loader.resolve import DEFAULT_MODEL

MAX_MODEL_LEN = 1024
KV_CACHE_BYTES = 96 * 2**20
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # float32: the exact mode, whose tokens the expectations here were written against (and
    # the offline engine below computes alike). (Ctrl-C shuts it down cleanly)
    yield from serving(extra=("--dtype", "float32"))


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(DEFAULT_MODEL, max_model_len=MAX_MODEL_LEN, kv_cache_memory=KV_CACHE_BYTES,
               dtype="float32")  # fmt: skip


def _greedy(max_tokens: int, **extra: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **extra)


def test_models_health_version(server: Server, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [DEFAULT_MODEL]
    assert server.request("GET", "/health", auth=False)[0] == 200
    status, body = server.request("GET", "/version")
    assert status == 200 and body["version"]


@pytest.mark.slow
def test_completion_equals_offline_greedy(client: openai.OpenAI, offline: LLM) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    got = client.completions.create(
        model=DEFAULT_MODEL, prompt=prompts, max_tokens=12, temperature=0
    )
    want = offline.generate(prompts, _greedy(12), use_tqdm=False)
    assert [c.text for c in got.choices] == [w.outputs[0].text for w in want]
    assert [c.index for c in got.choices] == [0, 1]
    assert got.usage is not None
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert got.usage.completion_tokens == sum(len(w.outputs[0].token_ids) for w in want)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_token_id_prompt_and_echo(client: openai.OpenAI, offline: LLM) -> None:
    ids = offline.get_tokenizer().encode("Once upon a time")
    got = client.completions.create(
        model=DEFAULT_MODEL, prompt=ids, max_tokens=6, temperature=0, echo=True
    )
    want = offline.generate([ids], _greedy(6), use_tqdm=False)[0]
    assert got.choices[0].text == "Once upon a time" + want.outputs[0].text


@pytest.mark.slow
def test_prompt_logprobs_match_offline(client: openai.OpenAI, offline: LLM) -> None:
    """vLLM's prompt_logprobs field: each prompt token's logprob and the top 2, by token
    id (None for the first), in completions' choices and chat's response, and streamed
    in each's first chunk."""
    prompt = "Paged attention keeps the cache in blocks"
    got = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=1,
                                    temperature=0, extra_body={"prompt_logprobs": 2})  # fmt: skip
    (want,) = offline.generate([prompt], _greedy(1, prompt_logprobs=2), use_tqdm=False)
    positions = got.choices[0].model_extra["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(want.prompt_token_ids)
    for token, mine, theirs in zip(want.prompt_token_ids[1:], positions[1:],
                                   want.prompt_logprobs[1:], strict=True):  # fmt: skip
        assert str(token) in mine and set(mine) == {str(t) for t in theirs}
        assert mine[str(token)]["logprob"] == pytest.approx(theirs[token].logprob, abs=1e-4)
    chat = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=1,
        extra_body={"prompt_logprobs": 1},
    )  # fmt: skip
    assert chat.model_extra["prompt_logprobs"][0] is None
    streamed = [c.choices[0].model_extra.get("prompt_logprobs") for c in client.completions.create(
        model=DEFAULT_MODEL, prompt=prompt, max_tokens=3, temperature=0, stream=True,
        extra_body={"prompt_logprobs": 2})]  # fmt: skip
    assert streamed[0] == positions and not any(streamed[1:])
    chunks = list(client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=3,
        stream=True, extra_body={"prompt_logprobs": 1}))  # fmt: skip
    sent = [c.model_extra.get("prompt_logprobs") for c in chunks]
    assert [p is not None for p in sent].count(True) == 1
    assert next(p for p in sent if p is not None) == chat.model_extra["prompt_logprobs"]


def test_best_of_keeps_the_n_most_likely_samples(client: openai.OpenAI) -> None:
    """best_of 4, n 2: the two of the same seed's four samples whose tokens' logprobs
    sum highest, most likely first, whole or streamed (at the end, a chunk each); best_of
    below n is a 400."""
    ask = dict(model=DEFAULT_MODEL, prompt="My favourite animal is", max_tokens=8,
               temperature=1.0, seed=7, logprobs=0)  # fmt: skip
    four = client.completions.create(n=4, **ask).choices  # type: ignore[call-overload]
    ranked = sorted(four, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    best = client.completions.create(n=2, best_of=4, **ask).choices  # type: ignore[call-overload]
    assert [c.text for c in best] == [c.text for c in ranked[:2]]
    chunks = client.completions.create(n=2, best_of=4, stream=True, **ask)  # type: ignore[call-overload]
    assert [(c.choices[0].index, c.choices[0].text) for c in chunks] == [
        (c.index, c.text) for c in best
    ]
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(**{**ask, "n": 2, "best_of": 1})  # type: ignore[call-overload]


def test_chat_equals_offline_chat(client: openai.OpenAI, offline: LLM) -> None:
    got = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=QUESTION, max_tokens=24, temperature=0
    )  # type: ignore[arg-type]
    want = offline.chat(QUESTION, _greedy(24), use_tqdm=False)[0]
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert got.usage is not None
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)


@pytest.mark.slow
def test_n_samples_stop_and_seed(client: openai.OpenAI, offline: LLM) -> None:
    args: dict[str, Any] = dict(model=DEFAULT_MODEL, prompt="My favourite animal is", max_tokens=16)
    two = client.completions.create(**args, n=2, temperature=1.0, seed=7)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.choices[0].text != two.choices[1].text
    again = client.completions.create(**args, n=2, temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in two.choices]  # seeded

    greedy = offline.generate(["My favourite animal is"], _greedy(16), use_tqdm=False)[0]
    text = greedy.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.completions.create(**args, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs_match_offline(client: openai.OpenAI, offline: LLM) -> None:
    prompt = "The quick brown fox"
    want = offline.generate([prompt], _greedy(5, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert want.logprobs is not None
    got = client.completions.create(
        model=DEFAULT_MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3
    )
    lp = got.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    expected = [p[t].logprob for p, t in zip(want.logprobs, want.token_ids, strict=True)]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert all(len(top) >= 3 for top in lp.top_logprobs)

    chat = client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=QUESTION,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )  # type: ignore[arg-type]
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the best
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI, offline: LLM) -> None:
    """OpenAI's logit_bias (token ids as strings): +100 makes every token the biased one;
    -100 on greedy's first token makes it another."""
    forced = client.completions.create(
        model=DEFAULT_MODEL, prompt="Hello", max_tokens=4, temperature=0, logit_bias={"42": 100}
    )
    want = offline.get_tokenizer().decode([42] * 4)
    assert forced.choices[0].text == want
    first = offline.generate(["Hello"], _greedy(1), use_tqdm=False)[0].outputs[0].token_ids[0]
    banned = client.completions.create(
        model=DEFAULT_MODEL,
        prompt="Hello",
        max_tokens=1,
        temperature=0,
        logit_bias={str(first): -100},
        logprobs=1,
    )
    assert banned.choices[0].logprobs is not None
    assert banned.choices[0].text != offline.get_tokenizer().decode([first])


def test_streaming_equals_whole(client: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(model=DEFAULT_MODEL, max_tokens=20, temperature=0)
    whole = client.chat.completions.create(messages=QUESTION, **args)  # type: ignore[arg-type]
    pieces, usage, finish = [], None, None
    for chunk in client.chat.completions.create(
        messages=QUESTION, stream=True, stream_options={"include_usage": True}, **args
    ):  # type: ignore[arg-type,call-overload]
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens

    text = "".join(
        c.choices[0].text
        for c in client.completions.create(prompt="Hello, my name is", stream=True, **args)
    )
    assert text == client.completions.create(prompt="Hello, my name is", **args).choices[0].text


def test_async_concurrent_streams(server: Server) -> None:
    """64 streams at once from one continuous batch; afterwards nothing is left running
    and the KV cache is back to idle."""

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int]:
        stream = await client.completions.create(
            model=DEFAULT_MODEL,
            prompt=f"Request number {i} says",
            max_tokens=12,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks, usage = 0, 0
        async for chunk in stream:
            chunks += bool(chunk.choices)
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return chunks, usage

    async def run() -> list[tuple[int, int]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert all(usage == 12 for _, usage in results)
    assert all(1 <= chunks <= 12 for chunks, _ in results)
    m = server.idle_metrics()
    assert m['num_requests_running{model_name="SmolLM2-135M-Instruct"}'] == 0
    assert m['num_requests_waiting{model_name="SmolLM2-135M-Instruct"}'] == 0
    assert m['kv_cache_usage_perc{model_name="SmolLM2-135M-Instruct"}'] == 0


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_blocks(server: Server, stream: bool) -> None:
    """A client that goes away mid-answer (streamed or not): its request is aborted and its
    KV blocks are freed."""
    running_key = 'num_requests_running{model_name="SmolLM2-135M-Instruct"}'
    abort_key = 'request_success_total{finished_reason="abort",model_name="SmolLM2-135M-Instruct"}'
    aborted_before = server.metrics().get(abort_key, 0.0)
    body = {"prompt": "Tell me a long story.", "max_tokens": 900, "ignore_eos": True}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps({**body, "stream": stream}),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    if stream:
        response = conn.getresponse()
        assert response.status == 200
        for _ in range(3):  # a few tokens in
            assert response.fp.readline()
    else:
        deadline = time.monotonic() + 30
        while server.metrics()[running_key] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert server.metrics()[running_key] == 1
    conn.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
    conn.close()
    m = server.idle_metrics()
    assert m[running_key] == 0
    assert m['kv_cache_usage_perc{model_name="SmolLM2-135M-Instruct"}'] == 0
    assert m[abort_key] == aborted_before + 1


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": 3}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "gpt-4"),
        ("/v1/completions", {"prompt": "word " * 1100}, 400, "maximum context length is 1024"),
        ("/v1/completions", {"prompt": "word " * 400_000}, 400, "more than that many tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1024}, 400, "(1 in the prompt, 1024"),
        ("/v1/completions", {"prompt": "a \ud800 b"}, 400, "not valid Unicode"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "\udfff"}]},
            400,
            "not valid Unicode",
        ),  # fmt: skip
        ("/v1/completions", {"prompt": "hi", "model": "\ud800"}, 404, "does not exist"),
        ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "vocabulary"),
        ("/v1/completions", {"prompt": []}, 400, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
        ("/v1/chat/completions", {"messages": QUESTION, "top_logprobs": 2}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "max_logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
        (
            "/v1/chat/completions",
            {"messages": QUESTION, "logprobs": True, "top_logprobs": 21},
            400,
            "max_logprobs",
        ),
        ("/v1/chat/completions", {"messages": QUESTION, "stream": "maybe"}, 400, "stream"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**40]}, 400, "stop_token_ids"),
        ("/v1/completions", {"prompt": "hi", "n": 2**40}, 400, "max_num_seqs"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 300}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1e999}, 400, "repetition"),
        (
            "/v1/chat/completions",
            {"messages": QUESTION, "chat_template": "{{ 1/0 }}"},
            400,
            "--trust-request-chat-template",
        ),
        (
            "/v1/chat/completions",
            {"messages": QUESTION, "chat_template_kwargs": {"bos_token": "x"}},
            400,
            "set by the engine",
        ),
    ],
)
def test_bad_requests_answer_errors(
    server: Server, path: str, body: dict[str, Any], status: int, needle: str
) -> None:
    got, error = server.request("POST", path, json.dumps(body))
    assert got == status
    assert needle in error["error"]["message"]
    assert error["error"]["code"] == status
    # ...and the server still serves
    ok, answer = server.request(
        "POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2})
    )
    assert ok == 200 and answer["usage"]["completion_tokens"] == 2


def test_nulls_model_lookup_and_unknown_routes(server: Server) -> None:
    """null for fields OpenAI allows it in (the default); GET /v1/models/{id}; errors in
    OpenAI's shape for routes that do not exist. (CORS: test_middlewares.py.)"""
    body = {"prompt": "hi", "max_tokens": 2, "n": None, "stream": None, "echo": None}
    status, answer = server.request("POST", "/v1/completions", json.dumps(body))
    assert status == 200 and answer["usage"]["completion_tokens"] == 2
    chat = {"messages": QUESTION, "max_tokens": 2, "n": None, "logprobs": None, "stream": None}
    status, answer = server.request("POST", "/v1/chat/completions", json.dumps(chat))
    assert status == 200 and len(answer["choices"]) == 1
    status, card = server.request("GET", f"/v1/models/{DEFAULT_MODEL}")
    assert status == 200 and card["id"] == DEFAULT_MODEL and card["object"] == "model"
    status, error = server.request("GET", "/v1/models/gpt-4")
    assert status == 404 and "gpt-4" in error["error"]["message"]
    status, error = server.request("GET", "/v1/nowhere")
    assert status == 404 and error["error"]["code"] == 404


def test_chat_logprob_bytes_join_into_the_text(client: openai.OpenAI, offline: LLM) -> None:
    """Each logprob's bytes are its token's own, so they join up even where a character
    spans tokens (which decode to U+FFFD one by one)."""
    answer = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True
    )
    content = answer.choices[0].logprobs.content  # type: ignore[union-attr]
    joined = b"".join(bytes(entry.bytes or []) for entry in content or [])
    # (The last entry can be the end-of-turn token, which the text leaves out.)
    assert joined.decode().removesuffix("<|im_end|>") == answer.choices[0].message.content
    tokenizer = offline.get_tokenizer()
    emoji = tokenizer.encode("a 😀 b", add_special_tokens=False)
    assert "\ufffd" in tokenizer.token_text(emoji[1])  # half of the emoji
    assert b"".join(tokenizer.token_bytes(t) for t in emoji).decode() == "a 😀 b"


def test_malformed_json_and_missing_key(server: Server) -> None:
    status, error = server.request("POST", "/v1/completions", "{not json")
    assert status == 400 and "malformed JSON" in error["error"]["message"]
    status, error = server.request(
        "POST", "/v1/completions", json.dumps({"prompt": "hi"}), auth=False
    )
    assert status == 401 and error["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_tokenize_detokenize(server: Server, offline: LLM) -> None:
    status, body = server.request("POST", "/tokenize", json.dumps({"prompt": "Hello world"}))
    assert status == 200
    assert body["tokens"] == offline.get_tokenizer().encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    status, body = server.request("POST", "/detokenize", json.dumps({"tokens": body["tokens"]}))
    assert status == 200 and body["prompt"] == "Hello world"
    status, body = server.request("POST", "/detokenize", json.dumps({"tokens": [-1]}))
    assert status == 400


def test_metrics_count_tokens_and_latencies(server: Server, client: openai.OpenAI) -> None:
    before = server.idle_metrics()
    key = 'generation_tokens_total{model_name="SmolLM2-135M-Instruct"}'
    client.completions.create(
        model=DEFAULT_MODEL, prompt="Count:", max_tokens=5, extra_body={"ignore_eos": True}
    )
    after = server.idle_metrics()
    assert after[key] == before.get(key, 0) + 5
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        count = f'{name}_count{{model_name="SmolLM2-135M-Instruct"}}'
        assert after[count] == before.get(count, 0) + 1


@pytest.mark.slow
def test_cli_generate(offline: LLM) -> None:
    prompt = "Name three colors."
    run = subprocess.run(
        [sys.executable, "-m", "pyengine.entrypoints.cli", "generate", prompt,
         "--max-tokens", "12", "--temperature", "0", "--max-model-len", str(MAX_MODEL_LEN),
         "--dtype", "float32"],
        capture_output=True, text=True, timeout=300, cwd=OUTSIDE_SOURCE_TREE,
        env={**os.environ, "PYENGINE_CPU_KV_CACHE_GIB": "0.1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    want = offline.chat([{"role": "user", "content": prompt}], _greedy(12), use_tqdm=False)
    assert run.stdout == want[0].outputs[0].text + "\n"


def test_console_script_runs_the_cli() -> None:
    (script,) = entry_points(group="console_scripts", name="pyengine")
    assert script.value == "pyengine.entrypoints.cli:main"
    run = subprocess.run(
        [sys.executable, "-m", "pyengine.entrypoints.cli", "serve", "--help"],
        capture_output=True, text=True, timeout=120, cwd=OUTSIDE_SOURCE_TREE,
    )  # fmt: skip
    assert run.returncode == 0
    for option in ("--api-key", "--served-model-name", "--kv-cache-memory", "--chat-template"):
        assert option in run.stdout


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_generate_and_chat_take_the_engines_options(command: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pyengine.entrypoints.cli", command, "--help"],
        capture_output=True, text=True, timeout=120, cwd=OUTSIDE_SOURCE_TREE,
    )  # fmt: skip
    assert run.returncode == 0
    for option in ("--tensor-parallel-size", "--quantization", "--kv-cache-dtype",
                   "--speculative-config", "--enable-lora", "--reasoning-parser"):  # fmt: skip
        assert option in run.stdout, option
    assert "--api-key" not in run.stdout  # (the server's alone)


def test_streamed_stop_string_is_held_back(client: openai.OpenAI, offline: LLM) -> None:
    """Text that could begin a stop string is not streamed until it cannot: the pieces
    add up to the whole answer, cut before the stop string."""
    prompt = "The days of the week are Monday,"
    greedy = offline.generate([prompt], _greedy(24), use_tqdm=False)[0].outputs[0].text
    stop = greedy[len(greedy) // 2 : len(greedy) // 2 + 4]
    args: dict[str, Any] = dict(model=DEFAULT_MODEL, prompt=prompt, max_tokens=24, temperature=0)
    whole = client.completions.create(**args, stop=[stop, "never appears here"])
    pieces = [
        c.choices[0].text
        for c in client.completions.create(**args, stop=[stop, "never appears here"], stream=True)
    ]
    assert whole.choices[0].text == greedy[: greedy.index(stop)]
    assert "".join(pieces) == whole.choices[0].text


def test_streamed_prompts_and_samples_keep_their_indices(client: openai.OpenAI) -> None:
    prompts = ["One, two,", "Red, green,"]
    args: dict[str, Any] = dict(model=DEFAULT_MODEL, prompt=prompts, max_tokens=6, n=2, seed=3)
    whole = client.completions.create(**args)
    texts: dict[int, str] = {}
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(texts) == [0, 1, 2, 3]  # prompt i, sample k -> index 2 * i + k
    assert [texts[c.index] for c in whole.choices] == [c.text for c in whole.choices]


def test_echo_with_logprobs_covers_the_prompt(client: openai.OpenAI, offline: LLM) -> None:
    prompt = "Hello there, friend"
    ids = offline.get_tokenizer().encode(prompt)
    got = client.completions.create(
        model=DEFAULT_MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    lp = got.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.text_offset is not None
    assert len(lp.token_logprobs) == len(ids) + 3
    assert lp.token_logprobs[0] is None  # the first prompt token has no logprob
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    assert got.choices[0].text.startswith(prompt)


def test_tokenize_messages_matches_the_chat_prompt(server: Server, offline: LLM) -> None:
    status, body = server.request("POST", "/tokenize", json.dumps({"messages": QUESTION}))
    assert status == 200
    want = offline.chat(QUESTION, _greedy(1), use_tqdm=False)[0].prompt_token_ids
    assert body["tokens"] == want
    both = {"prompt": "x", "messages": QUESTION}
    assert server.request("POST", "/tokenize", json.dumps(both))[0] == 400


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_response_format_json_schema_answers_validate(
    client: openai.OpenAI, temperature: float
) -> None:
    """response_format json_schema on chat, for 20 schemas (nested objects, arrays, enums,
    ranges, required fields, additionalProperties false): every answer parses and
    validates (jsonschema)."""
    jsonschema = pytest.importorskip("jsonschema")
    from helpers.schemas import SCHEMAS

    for i, schema in enumerate(SCHEMAS):
        answer = client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": "Answer with JSON that fits the task."}],
            max_tokens=200, temperature=temperature, seed=i,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
        )  # fmt: skip
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_chat_inputs_that_were_500s_are_400s_naming_the_field(server: Server) -> None:
    """chat_template_kwargs that would replace the template's own arguments, and a message
    without content (only an assistant's tool calls stand without it, as in OpenAI's API)."""
    cases = [
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"messages": [{"role": "user"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}, "messages"),
    ]
    for fields, param in cases:
        body = {"model": DEFAULT_MODEL, "messages": QUESTION, "max_tokens": 1, **fields}
        status, error = server.request("POST", "/v1/chat/completions", json.dumps(body))
        assert status == 400 and error["error"]["param"] == param, (fields, error)
    ok = {"model": DEFAULT_MODEL, "messages": QUESTION, "max_tokens": 1,
          "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    assert server.request("POST", "/v1/chat/completions", json.dumps(ok))[0] == 200


def test_json_object_and_vllms_constraint_fields(client: openai.OpenAI) -> None:
    """response_format json_object; vLLM's structured_outputs and guided_* fields on
    completions and chat."""
    chat = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=QUESTION, max_tokens=100, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
    checks = [
        ({"structured_outputs": {"regex": r"[A-Z][a-z]{2,8}"}},
         lambda t: re.fullmatch(r"[A-Z][a-z]{2,8}", t)),
        ({"structured_outputs": {"choice": ["Paris", "Lyon"]}}, lambda t: t in ("Paris", "Lyon")),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"guided_regex": r"\d{2}"}, lambda t: re.fullmatch(r"\d{2}", t)),
        ({"guided_json": {"type": "object", "properties": {"n": {"type": "integer"}},
                          "required": ["n"], "additionalProperties": False}},
         lambda t: isinstance(json.loads(t)["n"], int)),
        ({"guided_grammar": 'root ::= "a" | "b"'}, lambda t: t in ("a", "b")),
    ]  # fmt: skip
    for extra, holds in checks:
        done = client.completions.create(
            model=DEFAULT_MODEL, prompt="The capital of France is", max_tokens=40,
            temperature=0.7, seed=1, extra_body=extra,
        )  # fmt: skip
        assert done.choices[0].finish_reason == "stop" and holds(done.choices[0].text), extra


@pytest.mark.parametrize(
    ("body", "needle", "param"),
    [({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
      "json_schema.schema", "response_format"),
     ({"response_format": {"type": "xml"}}, "not one of text", "response_format"),
     ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
      "give one structured output constraint", "guided_regex"),
     ({"guided_json": {"type": "objectx"}}, "structured_outputs.json is not valid",
      "guided_json"),
     ({"guided_regex": "[a-"}, "structured_outputs.regex is not valid", "guided_regex"),
     ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one",
      "structured_outputs")],
)  # fmt: skip
def test_bad_constraints_answer_400(
    server: Server, body: dict[str, Any], needle: str, param: str | None
) -> None:
    got, error = server.request(
        "POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, **body})
    )
    assert got == 400 and needle in error["error"]["message"], error
    assert error["error"]["param"] == param
    ok, _ = server.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}))
    assert ok == 200


def test_auto_tool_choice_is_refused_without_a_parser(
    server: Server, client: openai.OpenAI
) -> None:
    """tools on a server started without --enable-auto-tool-choice: "auto" (the default
    with tools) is a 400 naming the flags; a named call still runs."""
    tools = [{"type": "function", "function": {"name": "now"}}]
    for choice in ({}, {"tool_choice": "auto"}):
        got, error = server.request(
            "POST",
            "/v1/chat/completions",
            json.dumps({"messages": QUESTION, "tools": tools, **choice}),
        )
        assert got == 400 and error["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in error["error"]["message"]
    forced = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=QUESTION, max_tokens=20, tools=tools,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "now"}},
    )  # fmt: skip
    assert forced.choices[0].message.tool_calls[0].function.name == "now"  # type: ignore[index]


def test_cache_salt_and_priority_fields(server: Server) -> None:
    """A body's cache_salt keeps its prompt's prefix-cache blocks to requests of that
    salt; a priority on a server scheduling "fcfs" is a 400 naming it."""
    prompt = "Salted prefixes stay apart between tenants of one server. " * 5

    def cached(**salt: str) -> int:
        status, body = server.request(
            "POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 1, **salt})
        )
        assert status == 200, body
        return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached(cache_salt="one") == 0 and cached(cache_salt="one") > 0
    assert cached(cache_salt="two") == 0 and cached() == 0
    for field, value in (("priority", 3), ("cache_salt", "")):
        status, error = server.request(
            "POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 1, field: value})
        )
        assert status == 400 and error["error"]["param"] == field, error
