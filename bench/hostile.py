"""Hostile requests beside a steady load: what each does to well-behaved clients, to
/health and to the server's memory.

One server (the default model, an API key), a few well-behaved clients asking for
completions all along (the bystanders), a poller of /health, and, one after another, the
requests a hostile client sends: a body announced without a key, stops, stop token ids
and logit_bias past their bounds and just inside them, output that never completes a
UTF-8 character, fan-out and logprobs past the bound, a schema nested too deeply, unique
large schemas, long prompts to tokenize, a burst past the waiting bound (its 429s). A
request served is one sequence, as a bystander is: what it costs beyond its share is
what it does to the others (each of a request's n samples is a share of its own, and
prompts x n is bounded by max_num_seqs). Plain requests of the served probes' lengths
come first: what one more sequence costs the bystanders by itself. Per probe: its
status, how long it took, the bystanders' slowdown (their tokens/s before all probes
over theirs while it ran), /health's worst latency, and the server's resident memory
growth (across the hostile probes: the plain ones warm up the batch shapes, and every KV
block is written once before anything is measured, the pool's pages being committed as
blocks are first written).

Target (issue 48): every probe refused with a 4xx in under 5 s or served with the
bystanders slowed less than 2x; memory growth under 300 MB across all of them.

    python -m bench.hostile [--model MODEL] [--bystanders 4] [--window 3] [--only TEXT]

(imports no pyengine: the server runs in its own process, as bench/soak.py's)
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .common import print_table, report
from .soak_server import Server, launch, rss_kib

KEY = "hostile-bench-key"
MAX_NUM_SEQS, MAX_MODEL_LEN, KV_CACHE_MIB = 8, 2048, 256
REFUSE_WITHIN_S, MAX_SLOWDOWN, MAX_GROWTH_MB = 5.0, 2.0, 300.0
PLAIN = (256, 512, 1024)  # tokens of the well-behaved twins of the served probes


def post(port: int, path: str, body: object, key: str | None = KEY) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", path, body=json.dumps(body), headers=headers)
    response = conn.getresponse()
    answer = response.status, response.read()
    conn.close()
    return answer


@dataclass
class Load:
    """The bystanders' completed tokens (time, count) and /health's latencies (time, s)."""

    port: int
    tokens: list[tuple[float, int]] = field(default_factory=list)
    health: list[tuple[float, float]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def bystander(self, i: int) -> None:
        body = {"prompt": f"Tell story number {i} about the sea.", "max_tokens": 32,
                "ignore_eos": True, "temperature": 0}  # fmt: skip
        while not self.stop.is_set():
            status, data = post(self.port, "/v1/completions", body)
            if status == 200:
                self.tokens.append(
                    (time.monotonic(), json.loads(data)["usage"]["completion_tokens"])
                )

    def poll_health(self) -> None:
        while not self.stop.is_set():
            start = time.monotonic()
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            conn.request("GET", "/health")
            conn.getresponse().read()
            conn.close()
            self.health.append((start, time.monotonic() - start))
            time.sleep(0.1)

    def rate(self, start: float, end: float) -> float:
        return sum(n for t, n in self.tokens if start <= t < end) / (end - start)

    def worst_health(self, start: float, end: float) -> float:
        return max((s for t, s in self.health if start <= t < end), default=0.0)


def raw_unauthorized(port: int) -> int:
    """Headers that announce 30 MB and no key: the status line, read before sending it."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        conn.sendall(head + b"Content-Length: 30000000\r\n\r\n{")
        return int(conn.recv(4096).split()[1])


def tokens_of(port: int, text: str) -> list[int]:
    return list(json.loads(post(port, "/tokenize", {"prompt": text})[1])["tokens"])


def probes(port: int) -> dict[str, Callable[[], str]]:
    """Each probe by name: it sends its requests and returns their statuses."""

    def completion(**fields: object) -> Callable[[], str]:
        return route("/v1/completions", {"prompt": "Say something:", "max_tokens": 16, **fields})

    lead = tokens_of(port, "😀")[0]  # (a token of a character's first bytes)
    nested = '{"type": "array", "items": ' * 5000 + '{"type": "object"}' + "}" * 5000

    def in_a_row(constrained: bool) -> Callable[[], str]:
        """40 short requests one after another, each with a schema of its own (or none)."""

        def send() -> str:
            statuses = set()
            for k in range(40):
                body: dict[str, object] = {"prompt": f"JSON {k}:", "max_tokens": 4}
                if constrained:
                    body["guided_json"] = {"type": "object", "properties": {
                        f"field_{k}_{j}": {"type": "string", "maxLength": j + 1}
                        for j in range(200)}}  # fmt: skip
                statuses.add(post(port, "/v1/completions", body)[0])
            return "/".join(map(str, sorted(statuses)))

        return send

    def burst() -> str:
        body = {"prompt": "Go:", "max_tokens": 8, "ignore_eos": True}
        with ThreadPoolExecutor(100) as pool:
            statuses = list(pool.map(lambda _: post(port, "/v1/completions", body)[0], range(100)))
        return "/".join(f"{s}x{statuses.count(s)}" for s in sorted(set(statuses)))

    def route(path: str, body: object) -> Callable[[], str]:
        return lambda: str(post(port, path, body)[0])

    return {
        # (plain requests of the served probes' lengths: what one more sequence costs)
        **{f"plain, {n} tokens": completion(max_tokens=n, ignore_eos=True) for n in PLAIN},
        "plain, 40 requests of 4 tokens in a row": in_a_row(False),
        "no key, 30 MB announced": lambda: str(raw_unauthorized(port)),
        "/detokenize 100k ids": route("/detokenize", {"tokens": [1] * 100_000}),
        "/tokenize 40k-char prompt": route("/tokenize", {"prompt": "word " * 8000}),
        "65 stop strings": completion(stop=[f"s{i}" for i in range(65)]),
        "64 stop strings of 64 chars, 256 tokens": completion(
            stop=[f"{i:02d}" + "z" * 62 for i in range(64)], max_tokens=256, ignore_eos=True),
        "5000 stop_token_ids (1000 distinct)": completion(
            stop_token_ids=[49151] * 4000 + list(range(48000, 49000)), max_tokens=256,
            ignore_eos=True),
        "logit_bias of 20000 ids": completion(logit_bias={str(t): 1.0 for t in range(20000)}),
        "logit_bias of 1024 ids, 256 tokens": completion(
            logit_bias={str(t): -5.0 for t in range(1024)}, max_tokens=256, ignore_eos=True),
        "+100 on a lead byte, 512 tokens": completion(
            logit_bias={str(lead): 100}, max_tokens=512, ignore_eos=True),
        "3 prompts x n=3": completion(prompt=["a", "b", "c"], n=3),
        "n=8 x 8000 tokens x 21 logprobs": completion(n=8, max_tokens=8000, logprobs=20),
        "1024 tokens x 21 logprobs": completion(max_tokens=1024, logprobs=20, ignore_eos=True),
        "nested guided_json": completion(guided_json=nested),
        "40 unique 200-field schemas in a row": in_a_row(True),
        "priority 2^40": completion(priority=2**40),
        "100 at once (waiting bound)": burst,
    }  # fmt: skip


def touch_every_kv_block(server: Server) -> None:
    """Prompts of distinct blocks, more than the KV cache holds: every block written once.
    The pool's pages are committed as its blocks are first written (and the prefix cache
    hands out unwritten blocks first), so that otherwise the resident memory would grow by
    the KV cache's size under any load."""
    per_prompt = (MAX_MODEL_LEN - 64) // server.block_size
    for k in range(server.num_blocks // per_prompt + 2):
        prompt = f"{k} " + "word " * (MAX_MODEL_LEN - 80)
        post(server.port, "/v1/completions", {"prompt": prompt, "max_tokens": 1})


def refused_fast(status: str, seconds: float) -> bool:
    return status.startswith("4") and "/" not in status and seconds < REFUSE_WITHIN_S


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="the server's --model (default: its default)")
    parser.add_argument("--bystanders", type=int, default=4)
    parser.add_argument(
        "--window", type=float, default=3.0, help="seconds each probe is measured at least"
    )
    parser.add_argument("--only", help="the probes whose names hold this text (a trial run)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pyengine-hostile-") as folder:
        options = ["--api-key", KEY, "--max-num-seqs", str(MAX_NUM_SEQS), "--kv-cache-memory",
                   str(KV_CACHE_MIB << 20)]  # fmt: skip
        server = launch(args.model, MAX_MODEL_LEN, options, Path(folder) / "server.log")
        try:
            rows, figures = run(server, args.bystanders, args.window, args.only)
        finally:
            server.stop()
    table = print_table(("probe", "status", "seconds", "bystanders' slowdown",
                         "/health worst ms", "RSS growth MB"), rows)  # fmt: skip
    print(f"\nresident memory grew {figures['rss_growth_mb']:.0f} MB across the hostile probes "
          f"({figures['rss_growth_with_plain_mb']:.0f} MB with the plain ones before them); "
          f"passed: {figures['passed']}")  # fmt: skip
    report("hostile", figures, tables=[table])


def run(
    server: Server, bystanders: int, window: float, only: str | None = None
) -> tuple[list[tuple[str, ...]], dict[str, object]]:
    touch_every_kv_block(server)
    load = Load(server.port)
    threads = [
        threading.Thread(target=load.bystander, args=(i,), daemon=True) for i in range(bystanders)
    ]
    threads.append(threading.Thread(target=load.poll_health, daemon=True))
    for thread in threads:
        thread.start()
    all_probes = {k: v for k, v in probes(server.port).items() if only is None or only in k}
    time.sleep(2 * window)  # (warm-up)
    start = time.monotonic()
    time.sleep(2 * window)
    baseline = load.rate(start, time.monotonic())
    rss_start = rss_kib(server.process.pid)
    rss_hostile: int | None = None  # once the plain twins have warmed up the batch shapes
    rows, results = [], {}
    for name, probe in all_probes.items():
        rss_before, began = rss_kib(server.process.pid), time.monotonic()
        if rss_hostile is None and not name.startswith("plain"):
            rss_hostile = rss_before
        status = probe()
        seconds = time.monotonic() - began
        # A probe that runs a while is measured over its own time (a quiet tail would
        # hide its cost); a quick one over the window, which its refusal began.
        if seconds < 1.0:
            time.sleep(window - seconds)
        end = time.monotonic()
        slowdown = baseline / max(load.rate(began, end), 1e-9)
        health_ms = 1000 * load.worst_health(began, end)
        growth = (rss_kib(server.process.pid) - rss_before) / 1024
        ok = refused_fast(status, seconds) or slowdown < MAX_SLOWDOWN
        results[name] = {"status": status, "seconds": round(seconds, 2),
                         "slowdown": round(slowdown, 2), "health_worst_ms": round(health_ms),
                         "ok": ok}  # fmt: skip
        rows.append((name, status, f"{seconds:.2f}", f"{slowdown:.2f}x", f"{health_ms:.0f}",
                     f"{growth:+.0f}"))  # fmt: skip
    load.stop.set()
    for thread in threads:
        thread.join(timeout=60)
    rss_end = rss_kib(server.process.pid)
    growth_mb = (rss_end - (rss_hostile if rss_hostile is not None else rss_start)) / 1024
    passed = all(r["ok"] for r in results.values()) and growth_mb < MAX_GROWTH_MB
    figures = {
        "baseline_bystander_tokens_per_s": round(baseline, 1),
        "max_slowdown_served": max(
            (
                r["slowdown"]
                for r in results.values()
                if not refused_fast(r["status"], r["seconds"])
            ),
            default=0.0,
        ),  # fmt: skip
        "max_refusal_seconds": max(
            (r["seconds"] for r in results.values() if refused_fast(r["status"], r["seconds"])),
            default=0.0,
        ),  # fmt: skip
        "health_worst_ms": max(r["health_worst_ms"] for r in results.values()),
        "rss_growth_mb": round(growth_mb, 1),
        "rss_growth_with_plain_mb": round((rss_end - rss_start) / 1024, 1),
        "median_slowdown": round(statistics.median(r["slowdown"] for r in results.values()), 2),
        "probes": results,
        "passed": passed,
    }
    return rows, figures


if __name__ == "__main__":
    main()
