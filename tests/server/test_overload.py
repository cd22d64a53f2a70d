"""A burst past the server's bound on waiting work (--max-waiting-requests: requests not
yet scheduled, those running never count): the excess is answered at once with 429,
Retry-After and OpenAI's error shape; every admitted request completes; nothing hangs or
stays held; the bound shows in /metrics. Bodies past --max-request-body-bytes are refused
with 413 before they are parsed."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.server import API_KEY, Server, serving

BOUND = 3
MODEL = 'model_name="SmolLM2-135M-Instruct"'


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serving(extra=["--max-waiting-requests", str(BOUND), "--max-num-seqs", "1",
                              "--max-waiting-prompt-tokens", "1024",
                              "--max-request-body-bytes", "20000"])  # fmt: skip


def complete(server: Server, prompt: str, max_tokens: int = 24) -> tuple[int, str | None, dict]:  # type: ignore[type-arg]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    response = conn.getresponse()
    answer = (response.status, response.getheader("Retry-After"), json.loads(response.read()))
    conn.close()
    return answer


def test_a_burst_past_the_bound_is_told_to_retry(server: Server) -> None:
    burst = 5 * BOUND
    with ThreadPoolExecutor(burst) as pool:
        answers = list(pool.map(lambda i: complete(server, f"Story {i}:"), range(burst)))
    done = [body for status, _, body in answers if status == 200]
    refused = [(after, body) for status, after, body in answers if status == 429]
    assert len(done) + len(refused) == burst, [a[0] for a in answers]
    # The running request does not count against the bound: BOUND more may wait behind
    # it (the bound counts requests not yet scheduled, as vLLM's --max-num-queued-reqs).
    assert len(done) >= BOUND + 1 and refused
    assert all(len(body["choices"][0]["text"]) > 0 for body in done)
    for after, body in refused:
        assert after == "1"
        error = body["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == 429
        assert "overloaded" in error["message"] and f"at most {BOUND}" in error["message"]
    m = server.idle_metrics()
    assert m[f"request_refused_total{{{MODEL}}}"] == len(refused)
    assert m[f"max_waiting_requests{{{MODEL}}}"] == BOUND
    assert m[f"num_requests_admitted_waiting{{{MODEL}}}"] == 0
    assert m[f"kv_cache_usage_perc{{{MODEL}}}"] == 0
    assert complete(server, "After the burst:")[0] == 200  # serving as before


def test_prompts_past_the_token_bound_are_refused(server: Server) -> None:
    """One request runs (one row at a time); a long prompt waits behind it, and another
    would pass the bound on waiting prompt tokens."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    running = {"prompt": "Go on:", "max_tokens": 300, "ignore_eos": True, "stream": True}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    conn.request("POST", "/v1/completions", body=json.dumps(running), headers=headers)
    stream = conn.getresponse()
    assert stream.status == 200 and stream.fp.readline()  # (its first token: it runs)
    long = "word " * 600
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(complete, server, long, 2)
        admitted = f"num_requests_admitted_waiting{{{MODEL}}}"
        deadline = time.monotonic() + 30
        while server.metrics()[admitted] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)  # (until the long prompt waits behind the running one)
        status, after, body = complete(server, long, 2)
        assert status == 429 and after == "1"
        assert "prompt tokens would wait (at most 1024)" in body["error"]["message"]
        while b"[DONE]" not in stream.fp.readline():  # (the running one to its end)
            pass
        conn.close()
        assert waiting.result()[0] == 200
    assert server.idle_metrics()[f"num_requests_admitted_waiting{{{MODEL}}}"] == 0


def test_a_token_bound_below_max_model_len_stops_the_server() -> None:
    import subprocess
    import sys

    from helpers.server import OUTSIDE_SOURCE_TREE

    done = subprocess.run(
        [sys.executable, "-m", "pyengine.entrypoints.openai.api_server", "--max-model-len",
         "512", "--max-waiting-prompt-tokens", "100"],
        capture_output=True, text=True, cwd=OUTSIDE_SOURCE_TREE, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0 and "could never be admitted" in done.stderr


def test_a_body_past_the_limit_is_refused_before_parsing(server: Server) -> None:
    def post(body: bytes, chunked: bool) -> tuple[int, dict]:  # type: ignore[type-arg]
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
        pieces = (body[i : i + 4096] for i in range(0, len(body), 4096))
        conn.request("POST", "/v1/completions", body=pieces if chunked else body,
                     headers=headers, encode_chunked=chunked)  # fmt: skip
        response = conn.getresponse()
        answer = response.status, json.loads(response.read())
        conn.close()
        return answer

    def body(padding: int) -> bytes:
        return json.dumps({"prompt": "Hi", "max_tokens": 1, "user": "x" * padding}).encode()

    for chunked in (False, True):
        status, error = post(body(30_000), chunked)
        assert status == 413 and error["error"]["type"] == "request_too_large", error
        assert "larger than 20000 bytes" in error["error"]["message"]
        assert post(body(15_000), chunked)[0] == 200
    assert post(b"{" * 25_000, False)[0] == 413  # (never parsed: no JSON error)
