"""Requests a hostile client sends, through a real server process over raw HTTP: each is
refused with a 4xx naming the field (never a 500) or served within the server's bounds,
/health keeps answering, and nothing is left held afterwards. Every route but /health
needs the key, checked from the headers before the body is read."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.server import Server, serving

MAX_NUM_SEQS, MAX_OUTPUT_ENTRIES = 8, 20000
MODEL = 'model_name="SmolLM2-135M-Instruct"'


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serving(extra=["--max-num-seqs", str(MAX_NUM_SEQS), "--max-output-entries",
                              str(MAX_OUTPUT_ENTRIES)])  # fmt: skip


def complete(server: Server, **fields: object) -> tuple[int, dict]:  # type: ignore[type-arg]
    body = {"prompt": "Say something:", "max_tokens": 4, **fields}
    return server.request("POST", "/v1/completions", json.dumps(body))  # type: ignore[return-value]


def refused(server: Server, param: str, **fields: object) -> str:
    status, answer = complete(server, **fields)
    assert status == 400 and answer["error"]["param"] == param, (status, answer)
    return str(answer["error"]["message"])


def test_every_route_but_health_needs_the_key(server: Server) -> None:
    routes = [("GET", "/metrics"), ("GET", "/version"), ("GET", "/docs"),
              ("GET", "/openapi.json"), ("GET", "/v1/models"), ("POST", "/tokenize"),
              ("POST", "/detokenize"), ("POST", "/v1/completions"),
              ("GET", "/nowhere")]  # fmt: skip
    for method, path in routes:
        status, answer = server.request(method, path, '{"tokens": [1]}', auth=False)
        assert status == 401, (path, status)
        status, _ = server.request(method, path, '{"tokens": [1]}', auth="wrong")
        assert status == 401, (path, status)
    assert server.request("GET", "/health", auth=False)[0] == 200
    assert server.request("GET", "/version")[0] == 200


def test_the_key_is_checked_before_the_body_is_read(server: Server) -> None:
    """Headers that announce 30 MB and no key: refused at once, the body never sent."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        conn.sendall(head + b"Content-Length: 30000000\r\n\r\n{")
        start = time.monotonic()
        head = conn.recv(4096)
    assert head.startswith(b"HTTP/1.1 401") and time.monotonic() - start < 5


def test_stop_strings_and_stop_token_ids_are_bounded(server: Server) -> None:
    assert "65 stop strings" in refused(server, "stop", stop=[f"s{i}" for i in range(65)])
    assert "characters of stop strings" in refused(server, "stop", stop=["x" * 5000])
    assert "1025 distinct stop_token_ids" in refused(
        server, "stop_token_ids", stop_token_ids=list(range(1, 1026))
    )
    # Repeats are one id each (the scheduler keeps them once, sorted).
    status, answer = complete(server, stop_token_ids=[5] * 5000 + list(range(900, 1000)))
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1


def test_logit_bias_is_bounded_and_a_large_one_served(server: Server) -> None:
    assert "1025 logit_bias entries" in refused(
        server, "logit_bias", logit_bias={str(t): 1.0 for t in range(1025)}
    )
    forced = server.request("POST", "/tokenize", '{"prompt": " hello"}')[1]["tokens"][-1]
    bias = {str(t): 0.0 for t in range(1023)} | {str(forced): 100.0}  # 1024 entries
    status, answer = complete(server, logit_bias=bias, max_tokens=6, temperature=0)
    assert status == 200
    expected = server.request("POST", "/detokenize", json.dumps({"tokens": [forced] * 6}))
    assert answer["choices"][0]["text"] == expected[1]["prompt"]


def test_fan_out_and_output_size_are_bounded(server: Server) -> None:
    message = refused(server, "prompt", prompt=["a", "b", "c"], n=3)
    assert f"9 sequences, more than max_num_seqs ({MAX_NUM_SEQS})" in message
    # n x max_tokens x (logprobs + 1) = 2 x 500 x 21 = 21000 > 20000
    assert "21000 output entries" in refused(server, "max_tokens", n=2, max_tokens=500,
                                             logprobs=20)  # fmt: skip
    status, _ = complete(server, n=2, max_tokens=4, logprobs=20)
    assert status == 200


def test_a_cache_salt_that_is_not_unicode_is_a_400(server: Server) -> None:
    assert "not valid Unicode" in refused(server, "cache_salt", cache_salt="\ud800")


def test_detokenize_takes_at_most_max_model_len_tokens(server: Server) -> None:
    status, answer = server.request("POST", "/detokenize", json.dumps({"tokens": [1] * 5000}))
    assert status == 400 and answer["error"]["param"] == "tokens"


def test_a_deeply_nested_schema_is_a_400(server: Server) -> None:
    text = '{"type": "array", "items": ' * 5000 + '{"type": "object"}' + "}" * 5000
    status, answer = complete(server, guided_json=text)
    assert status == 400 and answer["error"]["param"] == "guided_json", answer
    nested = "[" * 100000 + "]" * 100000  # (as the body itself: JSON too deep to parse)
    status, answer = server.request("POST", "/v1/completions",
                                    '{"prompt": "x", "extra": ' + nested + "}")  # fmt: skip
    assert status == 400, answer


def test_a_bystander_keeps_half_its_speed_and_health_answers(server: Server) -> None:
    """Requests served within their bounds, each beside a well-behaved one: a byte that
    never completes a character (the detokenizer's bound), 1024 logit_bias entries, 64
    long stop strings, 1000 stop token ids. The well-behaved request keeps at least half
    the speed it has alone, and /health answers within a second all along."""
    lead = server.request("POST", "/tokenize", json.dumps({"prompt": "😀"}))[1]["tokens"][0]
    hostile = [
        {"logit_bias": {str(lead): 100}},
        {"logit_bias": {str(t): -1.0 for t in range(1024)}},
        {"stop": [f"{i:02d}" + "z" * 62 for i in range(64)]},
        {"stop_token_ids": list(range(48000, 49000))},
    ]

    def speed() -> float:
        start = time.monotonic()
        status, answer = complete(server, max_tokens=48, ignore_eos=True)
        assert status == 200
        return int(answer["usage"]["completion_tokens"]) / (time.monotonic() - start)

    alone = max(speed() for _ in range(3))
    worst_health = 0.0
    for fields in hostile:
        with ThreadPoolExecutor(2) as pool:
            probe = pool.submit(complete, server, max_tokens=400, ignore_eos=True, **fields)
            time.sleep(0.2)  # (it runs)
            beside = speed()
            while not probe.done():
                start = time.monotonic()
                assert server.request("GET", "/health", auth=False)[0] == 200
                worst_health = max(worst_health, time.monotonic() - start)
                time.sleep(0.05)
            assert probe.result()[0] == 200
        assert beside >= alone / 2, (fields.keys(), beside, alone)
    assert worst_health < 1.0


def test_nothing_is_left_held(server: Server) -> None:
    m = server.idle_metrics()
    assert m[f"kv_cache_usage_perc{{{MODEL}}}"] == 0
    assert m[f"num_requests_admitted_waiting{{{MODEL}}}"] == 0
    assert server.request("GET", "/health", auth=False)[0] == 200


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own priority is Linux's")
def test_grammars_compile_below_the_engines_priority() -> None:
    """The grammar thread runs at a niceness 10 above the process's: a client's unique
    schemas take the cores from the engine's kernels only where they are idle."""
    from pyengine.entrypoints.openai.serving import OpenAIServing

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    assert OpenAIServing.grammar_thread.submit(niceness).result() == min(19, niceness() + 10)
