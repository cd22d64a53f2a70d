"""A client that stops reading its stream must not slow anyone else (--stream-stall-timeout):
its connection's buffers fill, and once a send has waited past the timeout the connection
is closed, the request aborted and counted in /metrics, and a log line says so; 32
clients that read meanwhile get their whole, correct answers; no KV block is left. The
guard's timing alone, against a fake connection: sends that finish never count, however
long the response; a send that waits is cut at its timeout."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers.server import API_KEY, Server

from pyengine.entrypoints.openai.slow_clients import StallGuard

STALL_TIMEOUT = 2.0
READERS = 32
MAX_TOKENS = 32
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]
MODEL = 'model_name="SmolLM2-135M-Instruct"'
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}


def whole(server: Server, prompts: list[str]) -> dict[str, str]:
    """Each prompt's greedy completion, not streamed (one request)."""
    body = {"prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    status, answer = server.request("POST", "/v1/completions", json.dumps(body))
    assert status == 200, answer
    return {prompts[c["index"]]: c["text"] for c in answer["choices"]}


def streamed(server: Server, prompt: str) -> tuple[str, str | None]:
    """A streamed greedy completion read as it comes: its text and finish reason."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=HEADERS)
    response = conn.getresponse()
    assert response.status == 200
    text, reason = "", None
    while (line := response.fp.readline().decode()) and line != "data: [DONE]\n":
        if line.startswith("data: "):
            for choice in json.loads(line[6:])["choices"]:
                text += choice["text"]
                reason = choice["finish_reason"] or reason
    conn.close()
    return text, reason


def never_reading(server: Server) -> socket.socket:
    """A streamed request for many tokens from a client that never reads. Its receive
    buffer is small, and so is its segment size (on loopback the server's send buffer
    grows with it, to megabytes by default). Its first event, the echoed prompt with
    20 logprobs a token (some 360 KB), fills every buffer between it and the server at
    once: the next send waits from then on."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(("127.0.0.1", server.port))
    body = json.dumps({"prompt": "word " * 600, "max_tokens": 1400, "echo": True,
                       "logprobs": 20, "ignore_eos": True, "stream": True})  # fmt: skip
    head = "".join(f"{k}: {v}\r\n" for k, v in HEADERS.items())
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    return sock


def wait_for_its_first_event(sock: socket.socket) -> None:
    """Until the first event arrives (past the response's head), seen without reading it."""
    sock.settimeout(60)
    while len(sock.recv(8192, socket.MSG_PEEK)) < 4096:
        time.sleep(0.01)


def server_holds(server: Server, sock: socket.socket, within: float = 5.0) -> bool:
    """Whether the server's process still holds its end of `sock`'s connection after
    `within` seconds (Linux's /proc/net/tcp: an end no process holds has inode 0). A
    plain close of a connection whose buffers are full would hold it until the client
    reads."""
    ends = f"0100007F:{server.port:04X} 0100007F:{sock.getsockname()[1]:04X}"
    deadline = time.monotonic() + within
    while True:
        rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
        held = any(f"{row[1]} {row[2]}" == ends and row[9] != "0" for row in rows)
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


def closed_without_done(sock: socket.socket) -> bool:
    """Reads what the server had sent until the connection ends: True where it ended (reset
    or closed) before the stream's [DONE]."""
    sock.settimeout(30)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return b"data: [DONE]" not in received


@pytest.mark.slow
def test_a_client_that_stops_reading_is_cut_off_and_slows_no_one() -> None:
    # (room in the KV cache for every row: no reader waits for the non-reader's blocks)
    server = Server(
        max_model_len=2048, kv_cache_bytes=256 * 2**20,
        extra=["--stream-stall-timeout", str(STALL_TIMEOUT)],
    )  # fmt: skip
    try:
        expected = whole(server, PROMPTS)
        stalled = f"stream_stalled_total{{{MODEL}}}"
        assert server.metrics()[stalled] == 0
        sock = never_reading(server)
        wait_for_its_first_event(sock)
        full = time.monotonic()  # (its buffers are full: its next send waits)

        def cut_after() -> float:
            while server.metrics()[stalled] == 0 and time.monotonic() - full < 60:
                time.sleep(0.05)
            return time.monotonic() - full

        with ThreadPoolExecutor(READERS + 1) as pool:  # (the readers read meanwhile)
            cut = pool.submit(cut_after)
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(READERS)]
            answers = list(pool.map(lambda p: streamed(server, p), prompts))
        for prompt, (text, reason) in zip(prompts, answers, strict=True):
            assert (text, reason) == (expected[prompt], "length")
        # The timeout, plus a step or two (slow ones on a busy 2-core machine) before the
        # next send; its 1400 tokens would take far longer.
        assert STALL_TIMEOUT - 0.1 < cut.result() < STALL_TIMEOUT + 5, cut.result()
        assert server.metrics()[stalled] == 1
        assert not server_holds(server, sock)  # (closed, though the client read nothing)
        assert closed_without_done(sock)
        sock.close()
        m = server.idle_metrics()
        assert m[f"num_requests_running{{{MODEL}}}"] == 0
        assert m[f"kv_cache_usage_perc{{{MODEL}}}"] == 0
        assert m[f'request_success_total{{finished_reason="abort",{MODEL}}}'] == 1
        assert streamed(server, PROMPTS[0]) == (expected[PROMPTS[0]], "length")
    finally:
        code = server.stop() if server.process.poll() is None else server.process.returncode
    log = server.process.stdout.read()  # type: ignore[union-attr]
    assert code == 0, log
    assert f"took no data for {STALL_TIMEOUT:g} s: closing its connection" in log, log


class FakeConnection:
    """uvicorn's side of a response as StallGuard sees it: `send`, a bound method of what
    holds the connection's transport. While the client reads, a send returns at once;
    once it stops, a send waits until the connection is aborted (then returns, as
    uvicorn's does once the client is gone)."""

    def __init__(self) -> None:
        self.transport = self
        self.reading = True
        self.aborted_at: float | None = None
        self._gone = asyncio.Event()

    def abort(self) -> None:
        self.aborted_at = time.monotonic()
        self._gone.set()

    async def send(self, message: Any) -> None:
        if not self.reading:
            await self._gone.wait()


TIMEOUT = 0.3


async def streaming_app(connection: FakeConnection, send: Any) -> float:
    """Sends for three timeouts while the client reads, then once after it stopped:
    when that send began."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    deadline = time.monotonic() + 3 * TIMEOUT
    while time.monotonic() < deadline:
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
        await asyncio.sleep(TIMEOUT / 10)
    connection.reading = False
    began = time.monotonic()
    await send({"type": "http.response.body", "body": b"x", "more_body": True})
    return began


def test_a_send_that_waits_past_the_timeout_aborts_the_connection() -> None:
    connection, stalls, began = FakeConnection(), [], []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        began.append(await streaming_app(connection, send))

    guard = StallGuard(app, TIMEOUT, on_stalled=lambda: stalls.append(1))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "state": {}}
    asyncio.run(asyncio.wait_for(guard(scope, None, connection.send), 10))
    assert stalls == [1] and connection.aborted_at is not None
    assert TIMEOUT <= connection.aborted_at - began[0] < TIMEOUT + 0.2


def test_behind_another_server_a_stalled_send_is_cancelled() -> None:
    """No transport to abort: the handler waiting in the send is cancelled instead."""
    connection = FakeConnection()

    async def send(message: Any) -> None:  # (a plain function: no connection to reach)
        await connection.send(message)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await streaming_app(connection, send)

    async def run() -> None:
        guard = StallGuard(app, TIMEOUT)
        handler = asyncio.ensure_future(guard({"type": "http"}, None, send))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(handler, 10)
        assert handler.cancelled()

    asyncio.run(run())
