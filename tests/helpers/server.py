"""The OpenAI-compatible server as a user runs it, for the tests that drive it."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import openai

from pyengine.loader.resolve import DEFAULT_MODEL

API_KEY = "test-key"
# `python -m` puts the working folder first on sys.path: from the checkout it would
# import the source tree's pyengine (no compiled _C) instead of the installed one.
OUTSIDE_SOURCE_TREE = tempfile.gettempdir()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`python -m pyengine.entrypoints.openai.api_server` on a free port of 127.0.0.1,
    with the test's API key: the default model, or `model`, and `extra` options."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        max_model_len: int = 1024,
        kv_cache_bytes: int = 96 * 2**20,
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pyengine.entrypoints.openai.api_server",
                "--model",
                model,
                "--port",
                str(self.port),
                "--api-key",
                API_KEY,
                "--max-model-len",
                str(max_model_len),
                "--kv-cache-memory",
                str(kv_cache_bytes),
                "--uvicorn-log-level",
                "warning",
                *extra,
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=OUTSIDE_SOURCE_TREE,
            env=None if env is None else {**os.environ, **env},
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.process.stdout.read()}")  # type: ignore[union-attr]
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("the server did not come up")

    def request(
        self, method: str, path: str, body: bytes | str | None = None, auth: bool | str = True
    ) -> tuple[int, Any]:
        """The status and body (JSON decoded) of one request, with the test's API key
        (auth=False: none; a string: that key)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        headers = {"Content-Type": "application/json"}
        if auth:
            headers["Authorization"] = f"Bearer {API_KEY if auth is True else auth}"
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        conn.close()
        ctype = response.getheader("content-type", "")
        return response.status, json.loads(data) if "json" in ctype else data.decode()

    def metrics(self) -> dict[str, float]:
        status, text = self.request("GET", "/metrics")
        assert status == 200
        values = {}
        for line in text.splitlines():
            match = re.match(r"pyengine:(\w+)(\{[^}]*\})? (\S+)$", line)
            if match:
                values[match[1] + (match[2] or "")] = float(match[3])
        return values

    def idle_metrics(self, timeout: float = 30.0) -> dict[str, float]:
        """The metrics once nothing is running or waiting."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = sum(v for k, v in m.items() if k.startswith(("num_requests_", "kv_cache_")))
            if busy == 0 or time.monotonic() > deadline:
                return m
            time.sleep(0.2)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGINT)
        return self.process.wait(60)


def serving(*args: Any, **kwargs: Any) -> Iterator[Server]:
    """A module's server (a fixture's body: `yield from serving(...)`), which must stop
    cleanly on Ctrl-C after its tests."""
    s = Server(*args, **kwargs)
    try:
        yield s
    finally:
        if s.process.poll() is None:
            assert s.stop() == 0


def openai_client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
