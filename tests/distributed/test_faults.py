"""Faults of a `mp` run: a worker killed mid-generation, or one that stops answering,
ends the requests in flight with a clear error and every worker with it; a server's
/health turns 503 within seconds; a driver killed outright leaves no worker behind."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pyengine import LLM, SamplingParams
from pyengine.executor import ExecutorDeadError

pytestmark = pytest.mark.slow

ENGINE = dict(load_format="dummy", max_model_len=256, kv_cache_memory=2**22)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def wait_until(condition: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def worker_pids(llm: LLM) -> list[int]:
    return [int(d["pid"]) for d in llm.llm_engine.executor.ranks]  # type: ignore[attr-defined]


def later(seconds: float, action: object) -> None:
    threading.Timer(seconds, action).start()  # type: ignore[arg-type]


def test_a_worker_killed_mid_generation_fails_its_requests_and_ends_the_rest(model: str) -> None:
    llm = LLM(model, tensor_parallel_size=2, **ENGINE)
    pids = worker_pids(llm)
    later(1.0, lambda: os.kill(pids[1], signal.SIGKILL))
    with pytest.raises(ExecutorDeadError, match=f"worker rank 1 \\(pid {pids[1]}\\) died"):
        for _ in range(50):  # until the kill lands
            llm.generate([[1, 2, 3]] * 4, LONG, use_tqdm=False)
    assert wait_until(lambda: not any(alive(p) for p in pids), 10), "workers left behind"
    assert not llm.llm_engine.has_unfinished_requests()
    assert all(s.kv_cache.stats().num_used_blocks == 0 for s in llm.llm_engine.schedulers)
    with pytest.raises(ExecutorDeadError, match="died"):  # at once, not a hang
        llm.generate([[1, 2, 3]], LONG, use_tqdm=False)
    llm.llm_engine.shutdown()


def test_a_worker_that_stops_answering_times_out(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYENGINE_STEP_TIMEOUT_S", "3")
    llm = LLM(model, pipeline_parallel_size=2, **ENGINE)
    pids = worker_pids(llm)
    later(1.0, lambda: os.kill(pids[0], signal.SIGSTOP))
    started = time.monotonic()
    with pytest.raises(ExecutorDeadError, match="did not answer within 3 s"):
        for _ in range(50):
            llm.generate([[1, 2, 3]] * 4, LONG, use_tqdm=False)
    assert time.monotonic() - started < 30
    assert wait_until(lambda: not any(alive(p) for p in pids), 10), "workers left behind"
    llm.llm_engine.shutdown()


DRIVER = """
import sys, time
from pyengine import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, load_format="dummy", max_model_len=256,
          kv_cache_memory=2**22)
print(llm.llm_engine.executor.broadcast.name, *[d["pid"] for d in llm.llm_engine.executor.ranks],
      flush=True)
time.sleep(600)
"""


def test_a_killed_driver_leaves_no_worker_or_shared_memory(model: str) -> None:
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, model], stdout=subprocess.PIPE, text=True,
        cwd=tempfile.gettempdir(),
    )  # fmt: skip
    assert driver.stdout is not None
    name, *pids = driver.stdout.readline().split()
    assert len(pids) == 2 and all(alive(int(p)) for p in pids)
    assert Path(f"/dev/shm/{name}").exists()
    driver.kill()
    driver.wait(10)
    assert wait_until(lambda: not any(alive(int(p)) for p in pids), 15), "orphaned workers"
    assert wait_until(lambda: not Path(f"/dev/shm/{name}").exists(), 15), "shared memory left"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    status = conn.getresponse().status
    conn.close()
    return status


def complete(port: int, result: dict[str, object], streaming: threading.Event) -> None:
    """A streamed completion of several prompts; what the client got, in `result`;
    `streaming` set once the first tokens came."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": "tiny", "prompt": [[1, 2, 3 + i] for i in range(8)], "max_tokens": 240,
            "stream": True, "ignore_eos": True, "temperature": 0}  # fmt: skip
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        response = conn.getresponse()
        result["status"] = response.status
        lines = []
        for line in response:
            lines.append(line.decode())
            streaming.set()
        result["body"] = "".join(lines)
    except OSError as error:
        result["error"] = repr(error)
    finally:
        conn.close()


@pytest.fixture
def server(model: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "pyengine.entrypoints.openai.api_server", "--model", model,
         "--served-model-name", "tiny", "--load-format", "dummy", "-tp", "2",
         "--max-model-len", "256", "--kv-cache-memory", str(2**22), "--port", str(port),
         "--uvicorn-log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tempfile.gettempdir(),
    )  # fmt: skip

    def healthy() -> bool:
        try:
            return get(port, "/health") == 200
        except OSError:
            return False

    try:
        assert wait_until(healthy, 120), "the server did not come up"
        yield process, port
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def test_the_server_answers_503_once_a_worker_dies(
    server: tuple[subprocess.Popen[str], int],
) -> None:
    process, port = server
    workers = children(process.pid)
    ranks = [p for p in workers if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(ranks) == 2, workers  # the resource tracker besides
    result: dict[str, object] = {}
    streaming = threading.Event()
    client = threading.Thread(target=complete, args=(port, result, streaming))
    client.start()
    assert streaming.wait(60), result
    os.kill(ranks[0], signal.SIGKILL)
    killed = time.monotonic()
    assert wait_until(lambda: get(port, "/health") == 503, 10), "/health still 200"
    assert time.monotonic() - killed < 10
    client.join(60)
    assert not client.is_alive(), "the request in flight hangs"
    events = [e for e in str(result["body"]).split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 503 and "worker rank" in error["message"] and "died" in error["message"]
    process.send_signal(signal.SIGINT)
    process.wait(30)
    assert wait_until(lambda: not any(alive(p) for p in workers), 10), "workers left behind"


def test_a_worker_that_dies_between_requests_turns_health_503(
    server: tuple[subprocess.Popen[str], int],
) -> None:
    process, port = server
    ranks = [p for p in children(process.pid)
             if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]  # fmt: skip
    os.kill(ranks[1], signal.SIGKILL)
    assert wait_until(lambda: get(port, "/health") == 503, 10), "/health still 200"
    assert wait_until(lambda: not any(alive(p) for p in ranks), 10), "the other rank is left"
