"""The server process of bench/soak.py: started on a free loopback port with its log in
a file, its options read from --help, its resident memory read from /proc.

The benchmark's own process imports no pyengine (nor torch): a client that loaded the
compiled core would take memory and start-up time from the machine it measures, and a
rebuild of that library under a running process crashes it. So bench/serve.py's helpers,
which import pyengine, are not used here."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SERVER = "pyengine.entrypoints.openai.api_server"


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    port: int
    log: Path
    model_name: str  # the name it serves (requests send it)
    num_blocks: int
    block_size: int

    def stop(self) -> int:
        """SIGTERM (a drain), then the exit code."""
        self.process.terminate()
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def server_help() -> str:
    """The server's --help: which options this checkout has."""
    return subprocess.run(
        [sys.executable, "-m", SERVER, "--help"], capture_output=True, text=True,
        cwd=tempfile.gettempdir(), timeout=120,
    ).stdout  # fmt: skip


def launch(model: str | None, max_model_len: int, options: Sequence[str], log: Path) -> Server:
    """The server of `model` (None: its default) on a free loopback port, its log
    (stderr) in `log`, once healthy."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    command = [sys.executable, "-m", SERVER, "--port", str(port),
               "--max-model-len", str(max_model_len), "--uvicorn-log-level", "warning",
               *(["--model", model] if model else []), *options]  # fmt: skip
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=sink,
            cwd=tempfile.gettempdir(),  # not the checkout: its pyengine/ has no compiled _C
        )  # fmt: skip
    if not healthy(process, port, 300):
        process.kill()
        raise RuntimeError(f"the server did not come up; its log ends:\n{log_tail(log)}")
    text = log.read_text()
    kv = re.search(r"KV cache: (\d+) blocks of (\d+) tokens", text)
    served = re.search(r"serving ([^ ,]+)", text)
    if kv is None or served is None:
        process.kill()
        raise RuntimeError(f"the server's log does not say its KV cache's size or name ({log})")
    return Server(process, port, log, served[1], int(kv[1]), int(kv[2]))


def healthy(process: subprocess.Popen[bytes], port: int, seconds: float) -> bool:
    """Whether GET /health answers 200 within `seconds` (False at once if it exited)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                conn.sendall(
                    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
                )
                if b" 200 " in conn.recv(100):
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def log_tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")
