"""SIGTERM drains the server: new requests are answered 503 at once, the streams in
flight run to their end (within --shutdown-timeout), and the process exits 0; a stream
still running at the timeout ends with an error event."""

from __future__ import annotations

import http.client
import json
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from helpers.server import API_KEY, Server


def stream(server: Server, i: int, max_tokens: int) -> tuple[str | None, str]:
    """A streamed completion read to its end: its finish reason and its last event."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    body = {"prompt": f"Story {i}:", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}  # fmt: skip
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    response = conn.getresponse()
    assert response.status == 200
    reason, last = None, ""
    for line in response.read().decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            last = line
            for choice in event.get("choices", []):
                reason = choice.get("finish_reason") or reason
    conn.close()
    return reason, last


def refuses_new_requests(server: Server, within: float = 5.0) -> bool:
    """Whether a new request gets 503 (the drain's answer) within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        body_text = json.dumps({"prompt": "x", "max_tokens": 1})
        status, body = server.request("POST", "/v1/completions", body_text)
        if status == 503:
            assert body["error"]["message"] == "the server is shutting down"
            return server.request("GET", "/health", auth=False)[0] == 503
        time.sleep(0.02)
    return False


def started(server: Server) -> int:
    m = server.metrics()
    return int(sum(v for k, v in m.items() if k.startswith("num_requests_running")))


def sigterm_during_streams(
    server: Server, num_streams: int, max_tokens: int, while_draining: Callable[[], None]
) -> list[tuple[str | None, str]]:
    """Streams started (all running), then SIGTERM, then `while_draining()`; each
    stream's finish reason and last event, and the process's exit code checked 0."""
    try:
        with ThreadPoolExecutor(num_streams) as pool:
            streams = [pool.submit(stream, server, i, max_tokens) for i in range(num_streams)]
            deadline = time.monotonic() + 60
            while started(server) < num_streams and time.monotonic() < deadline:
                time.sleep(0.05)
            server.process.send_signal(signal.SIGTERM)
            while_draining()
            assert not all(s.done() for s in streams)
            results = [s.result(timeout=120) for s in streams]
        assert server.process.wait(60) == 0
        log = server.process.stdout.read()  # type: ignore[union-attr]
        assert "stopped: 0 requests unfinished, 0 KV blocks in use" in log, log
        return results
    finally:
        if server.process.poll() is None:
            server.process.kill()


def test_sigterm_lets_the_streams_in_flight_finish() -> None:
    server = Server(extra=["--max-num-seqs", "16", "--shutdown-timeout", "120"])

    def new_requests_refused() -> None:
        assert refuses_new_requests(server)  # (while the streams still run)

    results = sigterm_during_streams(server, 16, 60, new_requests_refused)
    assert [reason for reason, _ in results] == ["length"] * 16


def test_streams_past_the_shutdown_timeout_end_with_an_error_event() -> None:
    server = Server(extra=["--max-num-seqs", "4", "--shutdown-timeout", "1"])
    for reason, last in sigterm_during_streams(server, 4, 900, lambda: None):
        assert reason is None  # (cut, not finished)
        error = json.loads(last[6:])["error"]
        assert "the server shut down before the request finished" in error["message"]
