"""Soak: the OpenAI server under a mixed overload for a set time, then checked for lost
requests, leaked KV blocks and grown memory; and the KV host tier on and off on a
prefix-heavy workload.

The server (the default model, started here on loopback) runs with a bound on waiting
requests and a small running batch. Its capacity is measured first (plain requests in a
closed loop, as many as the batch holds), then Poisson arrivals come at twice that, so
that some are refused with 429 (or 503) and Retry-After. The requests: chat and completions,
whole and streamed, some with n = 2, from tenants that each have a long system prompt
of their own and an API key whose cache salt keeps their prefix-cache blocks apart
(`--cache-salt-per-api-key`; the body's `cache_salt` is sent too, and replaced). Among
them 5% clients that disconnect mid-stream, 5% that never read their stream (a small
receive buffer; a stream-stall timeout on the server ends them where the server has
one), 3% that abort at a random moment, and 2% malformed or invalid requests (bad JSON,
empty messages, bad parameters, an unknown model, a wrong key), which must get a 4xx.
A warm-up writes the whole KV pool once (its pages are committed as first written, which
is no leak) and runs the mix for a while before resident memory is first read.

Checked at the end, once the load has stopped and the server is idle: every request got
an answer or was cut by its own client (lost: 0); the KV cache's usage on /metrics is
back to zero (no block leaked); the server's resident memory (VmRSS) grew less than 5%
over the measured load; every malformed request got a 4xx. The benchmark exits 1
otherwise.

Then, where the server has a KV host tier (`--kv-offload-gb`): a workload of prefixes
that together exceed a small device pool, sent round-robin, with the tier and without:
prompt tokens, cached ones, prefill tokens computed, and TTFT at p50.

The last line printed is one JSON object, also written to bench/results/soak.json.

    python -m bench.soak [--duration 600] [--smoke] [--rate R] [--seed 0]

(from the repository root; `--smoke` is a 60 s run)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import tempfile
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .common import print_table, report
from .soak_load import Outcome, Record, exchange, get, metric, parse_metrics
from .soak_server import Server, launch, log_tail, rss_kib, server_help
from .soak_tier import TierConfig, print_tier, tier_run
from .soak_workload import Mix, Workload, api_key

RSS_GROWTH_LIMIT = 0.05


@dataclass(frozen=True)
class SoakConfig:
    model: str | None = None  # None: the server's default
    duration_s: float = 600.0
    warmup_s: float = 60.0
    rate: float | None = None  # requests/s; None: `overload` times the measured capacity
    overload: float = 2.0
    calibrate_s: float = 20.0
    seed: int = 0
    max_num_seqs: int = 16
    max_waiting_requests: int = 16
    kv_cache_mib: int = 256
    max_model_len: int = 1024
    tenants: int = 4
    stall_timeout_s: float = 5.0
    drain_s: float = 180.0  # after the load: what has no answer by then is lost
    mix: Mix = field(default_factory=Mix)


@dataclass(frozen=True)
class IdleState:
    kv_blocks_in_use: int
    rss_kib: int
    metrics: dict[str, float]  # /metrics, every series


async def idle_state(server: Server, workload: Workload, timeout: float = 120.0) -> IdleState:
    """Waits until the server holds no request, runs one tiny request (the gauges are
    written after a step: this makes sure one ran after the last abort), then reads its
    KV usage and resident memory."""
    names = ("pyengine:num_requests_running", "pyengine:num_requests_waiting",
             "pyengine:num_requests_admitted_waiting")  # fmt: skip
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        values = parse_metrics((await get(server.port, "/metrics"))[1].decode())
        if not any(metric(values, name) for name in names):
            break
        if loop.time() > deadline:
            raise RuntimeError(f"the server is not idle after {timeout:.0f} s: {values}")
        await asyncio.sleep(0.5)
    probe = Record("plain")
    await exchange(server.port, workload.probe_call(), probe)
    if probe.outcome is not Outcome.COMPLETED:
        raise RuntimeError(f"the idle probe failed: {probe.outcome} {probe.detail}")
    values = parse_metrics((await get(server.port, "/metrics"))[1].decode())
    usage = metric(values, "pyengine:kv_cache_usage_perc")
    return IdleState(round(usage * server.num_blocks), rss_kib(server.process.pid), values)


async def health_watch(port: int, stop: asyncio.Event, tally: Counter[str]) -> None:
    """GET /health once a second while the load runs: under overload it must still
    answer 200, and at once."""
    while not stop.is_set():
        try:
            status, _ = await get(port, "/health", timeout=5.0)
            tally["ok" if status == 200 else f"status {status}"] += 1
        except (OSError, asyncio.TimeoutError) as error:
            tally[type(error).__name__] += 1
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


async def guarded(record: Record, client: Coroutine[Any, Any, None]) -> None:
    """A client that raised (an answer it could not read) is an errored request."""
    try:
        await client
    except Exception as error:
        if record.outcome is None:
            record.outcome, record.detail = Outcome.ERRORED, f"client: {error!r}"[:300]


async def run_load(
    server: Server, workload: Workload, seconds: float, rate: float, drain_s: float
) -> tuple[list[Record], Counter[str]]:
    """Poisson arrivals of the mix for `seconds`; then waits up to `drain_s` for the
    answers. A request with no outcome by then is lost."""
    loop = asyncio.get_running_loop()
    load_over = asyncio.Event()
    health: Counter[str] = Counter()
    watcher = asyncio.create_task(health_watch(server.port, load_over, health))
    records: list[Record] = []
    tasks = []
    end = loop.time() + seconds
    while (now := loop.time()) < end:
        await asyncio.sleep(min(workload.rng.exponential(1 / rate), end - now))
        record, client = workload.next_client(server.port, load_over)
        records.append(record)
        tasks.append(asyncio.create_task(guarded(record, client)))
    load_over.set()
    await watcher
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for record in records:
        if record.outcome is None:
            record.outcome = Outcome.LOST
            record.detail = f"no answer {drain_s:.0f} s after the load"
    return records, health


async def fill_kv_pool(server: Server, workload: Workload, concurrency: int = 4) -> None:
    """Unique prompts, more tokens in all than the pool holds: every block is written
    once (blocks are taken from the never-used ones first), so that the pool's pages
    are committed before memory is first read."""
    count = math.ceil(1.5 * server.num_blocks * server.block_size / workload.fill_words)
    limit = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with limit:
            await exchange(server.port, workload.fill_call(i), Record("plain"))

    await asyncio.gather(*(one(i) for i in range(count)))


@dataclass
class SoakResult:
    records: list[Record]
    warmup_lost: int
    health: Counter[str]
    start: IdleState
    end: IdleState
    capacity: float  # requests/s, measured
    rate: float  # requests/s, offered
    model_name: str = ""
    exit_code: int = 0
    stall_timeout: bool = False


async def calibrate(server: Server, workload: Workload, seconds: float, concurrency: int) -> float:
    """Plain requests/s the server completes with `concurrency` of them always in flight
    (a closed loop): about what it can serve. Measured rather than set, since it varies
    severalfold with the machine and what else runs on it."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    completed = 0

    async def client() -> None:
        nonlocal completed
        while loop.time() < start + seconds:
            record = Record("plain")
            await exchange(server.port, workload.plain(), record)
            completed += record.outcome is Outcome.COMPLETED

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return completed / (loop.time() - start)


async def soak(cfg: SoakConfig, server: Server, workload: Workload) -> SoakResult:
    await fill_kv_pool(server, workload)
    capacity = await calibrate(server, workload, cfg.calibrate_s, cfg.max_num_seqs)
    if capacity == 0:
        raise RuntimeError(f"no request completed in {cfg.calibrate_s:.0f} s of calibration")
    rate = cfg.rate if cfg.rate is not None else cfg.overload * capacity
    print(f"capacity ~{capacity:.2f} requests/s; arrivals at {rate:.2f}/s")
    warmup, _ = await run_load(server, workload, cfg.warmup_s, rate, cfg.drain_s)
    start = await idle_state(server, workload)
    print(f"warm-up done ({len(warmup)} requests); the measured load runs {cfg.duration_s:.0f} s")
    records, health = await run_load(server, workload, cfg.duration_s, rate, cfg.drain_s)
    end = await idle_state(server, workload)
    lost = sum(r.outcome is Outcome.LOST for r in warmup)
    return SoakResult(records, lost, health, start, end, capacity, rate)


def run_soak(cfg: SoakConfig, help_text: str, log_dir: Path) -> SoakResult:
    options = [
        "--max-num-seqs", str(cfg.max_num_seqs),
        "--max-waiting-requests", str(cfg.max_waiting_requests),
        "--kv-cache-memory", str(cfg.kv_cache_mib << 20),
        "--cache-salt-per-api-key",
    ]  # fmt: skip
    for i in range(cfg.tenants):
        options += ["--api-key", api_key(i)]
    if "--public-metrics" in help_text:  # (where /metrics needs the key, it is opened)
        options.append("--public-metrics")
    stall = "--stream-stall-timeout" in help_text
    if stall:
        options += ["--stream-stall-timeout", str(cfg.stall_timeout_s)]
    server = launch(cfg.model, cfg.max_model_len, options, log_dir / "soak-server.log")
    workload = Workload(server.model_name, cfg.mix, np.random.default_rng(cfg.seed),
                        cfg.stall_timeout_s, cfg.tenants)  # fmt: skip
    try:
        result = asyncio.run(soak(cfg, server, workload))
    except BaseException:
        died = server.process.poll()
        print(f"the server {'exited ' + str(died) if died is not None else 'runs'}; its log "
              f"ends:\n{log_tail(server.log)}", file=sys.stderr)  # fmt: skip
        raise
    finally:
        exit_code = server.stop()
    return replace(result, model_name=server.model_name, exit_code=exit_code,
                   stall_timeout=stall)  # fmt: skip


def ms(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q) * 1000:.0f}" if values else "-"


def seconds(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def outcome_table(records: list[Record]) -> str:
    columns = list(Outcome)
    kinds = ["plain", "disconnect", "abort", "never_read", "malformed"]
    rows = []
    for kind in [*kinds, "all"]:
        mine = [r for r in records if kind in ("all", r.kind)]
        count = Counter(r.outcome for r in mine)
        rows.append((kind, str(len(mine)), *(str(count[c]) for c in columns)))
    return print_table(("client", "sent", *(c.value for c in columns)), rows)


def counted(result: SoakResult, name: str) -> int | None:
    """A counter's increase over the measured load (None: the server has no such one)."""
    before, after = result.start.metrics, result.end.metrics
    if not any(k.startswith(name) for k in after):
        return None
    return int(metric(after, name) - metric(before, name))


def print_soak(cfg: SoakConfig, result: SoakResult) -> tuple[list[str], dict[str, Any]]:
    records = result.records
    count = Counter(r.outcome for r in records)
    mix = cfg.mix
    print(
        f"# Soak: {result.model_name}, {cfg.duration_s:.0f} s of Poisson arrivals at "
        f"{result.rate:.2f}/s ({result.rate / result.capacity:.1f}x the {result.capacity:.2f}/s "
        f"measured in a closed loop; after {cfg.warmup_s:.0f} s of warm-up), "
        f"--max-num-seqs {cfg.max_num_seqs}, --max-waiting-requests "
        f"{cfg.max_waiting_requests}, KV cache {cfg.kv_cache_mib} MiB, "
        f"stream-stall timeout {f'{cfg.stall_timeout_s:g} s' if result.stall_timeout else 'none'}"
        f"; {mix.disconnect:.0%} disconnect mid-stream, {mix.never_read:.0%} never read, "
        f"{mix.abort:.0%} abort, {mix.malformed:.0%} malformed\n"
    )
    outcomes = outcome_table(records)
    ttft = [r.ttft for r in records if r.ttft is not None and r.outcome is Outcome.COMPLETED]
    e2e = [r.e2e for r in records if r.e2e is not None and r.outcome is Outcome.COMPLETED]
    refused = [r.e2e for r in records if r.e2e is not None and r.status in (429, 503)]
    print()
    latency = print_table(
        ("latency (ms)", "requests", "p50", "p99"),
        [("TTFT (streamed, completed)", str(len(ttft)), ms(ttft, 50), ms(ttft, 99)),
         ("end-to-end (completed)", str(len(e2e)), ms(e2e, 50), ms(e2e, 99)),
         ("refusal (429/503)", str(len(refused)), ms(refused, 50), ms(refused, 99))],
    )  # fmt: skip
    start, end = result.start, result.end
    growth = end.rss_kib / start.rss_kib - 1
    print()
    state = print_table(
        ("server, idle", "after warm-up", "at the end"),
        [("resident memory (MiB)", f"{start.rss_kib / 1024:.1f}", f"{end.rss_kib / 1024:.1f}"),
         ("KV blocks in use", str(start.kv_blocks_in_use), str(end.kv_blocks_in_use))],
    )  # fmt: skip
    never = [r for r in records if r.kind == "never_read" and r.status == 200]
    stalled = counted(result, "pyengine:stream_stalled_total")
    server_refused = counted(result, "pyengine:request_refused_total")
    preempted = counted(result, "pyengine:num_preemptions_total")
    no_retry = sum(r.status in (429, 503) and r.retry_after is None for r in records)
    health_failed = sum(v for k, v in result.health.items() if k != "ok")
    print(
        f"\nresident memory grew {growth:+.1%}; /health failed {health_failed} of "
        f"{sum(result.health.values())} checks; never-read streams the server cut off: "
        f"{count[Outcome.STALLED]} of {len(never)} admitted (streams it counted as "
        f"stalled: {stalled}); 429s it counted: {server_refused}; preemptions: {preempted}; "
        f"refusals without "
        f"Retry-After: {no_retry}; server exit code after SIGTERM: {result.exit_code}"
    )
    for r in [r for r in records if r.outcome in (Outcome.LOST, Outcome.ERRORED,
                                                     Outcome.MALFORMED_ACCEPTED)][:5]:  # fmt: skip
        print(f"  {r.kind} {r.outcome.value if r.outcome else ''}: {r.detail[:200]}")
    figures = {
        "duration_s": cfg.duration_s,
        "capacity_per_s": round(result.capacity, 3),
        "rate_per_s": round(result.rate, 3),
        "sent": len(records),
        "completed": count[Outcome.COMPLETED],
        "refused_429": count[Outcome.REFUSED_429],
        "refused_503": count[Outcome.REFUSED_503],
        "malformed_4xx": count[Outcome.REJECTED],
        "malformed_not_4xx": count[Outcome.MALFORMED_ACCEPTED],
        "errored": count[Outcome.ERRORED],
        "cut_by_client": count[Outcome.CUT],
        "lost": count[Outcome.LOST] + result.warmup_lost,
        "completed_per_s": round(count[Outcome.COMPLETED] / cfg.duration_s, 3),
        "ttft_p50_s": seconds(ttft, 50),
        "ttft_p99_s": seconds(ttft, 99),
        "e2e_p50_s": seconds(e2e, 50),
        "e2e_p99_s": seconds(e2e, 99),
        "refusal_p99_s": seconds(refused, 99),
        "kv_blocks_leaked": end.kv_blocks_in_use,
        "rss_start_mib": round(start.rss_kib / 1024, 1),
        "rss_end_mib": round(end.rss_kib / 1024, 1),
        "rss_growth": round(growth, 4),
        "health_check_failures": health_failed,
        "refusals_without_retry_after": no_retry,
        "cut_by_server_stalled": count[Outcome.STALLED],
        "server_stream_stalled": stalled,
        "server_refused": server_refused,
        "preemptions": preempted,
        "server_exit_code": result.exit_code,
    }
    return [outcomes, latency, state], figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="the server's --model (default: its default)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--smoke", action="store_true", help="60 s of load, 15 s of warm-up")
    parser.add_argument("--warmup", type=float, help="seconds (default: 60, 15 with --smoke)")
    parser.add_argument(
        "--rate", type=float, help="requests/s (Poisson; default: twice the measured capacity)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-offload-dir", help="a folder for the host tier (CPU)")
    parser.add_argument("--no-tier", action="store_true", help="skip the KV host tier part")
    args = parser.parse_args()

    duration = 60.0 if args.smoke else args.duration
    warmup = args.warmup if args.warmup is not None else (15.0 if args.smoke else 60.0)
    cfg = SoakConfig(
        model=args.model, duration_s=duration, warmup_s=warmup, rate=args.rate, seed=args.seed
    )
    tier_cfg = TierConfig(offload_dir=args.kv_offload_dir)
    help_text = server_help()
    with tempfile.TemporaryDirectory(prefix="pyengine-soak-") as folder:
        log_dir = Path(folder)
        result = run_soak(cfg, help_text, log_dir)
        runs, skipped = None, "the server has no --kv-offload-gb"
        if args.no_tier:
            skipped = "--no-tier"
        elif "--kv-offload-gb" in help_text:
            try:
                runs = [tier_run(tier_cfg, on, log_dir, args.model) for on in (False, True)]
            except (RuntimeError, OSError, asyncio.TimeoutError) as error:
                skipped = f"failed: {error}"  # (the soak's figures are still reported)
    tables, figures = print_soak(cfg, result)
    tier_tables, tier_figures = print_tier(runs, tier_cfg, skipped)
    failures = checks(figures)
    print("\nchecks: " + ("passed" if not failures else "FAILED: " + "; ".join(failures)))
    report("soak", {**figures, **tier_figures, "passed": not failures},
           tables=[*tables, *tier_tables])  # fmt: skip
    sys.exit(1 if failures else 0)


def checks(figures: dict[str, Any]) -> list[str]:
    """What must hold: nothing lost, no KV block leaked, memory flat, malformed refused."""
    failures = []
    if figures["lost"]:
        failures.append(f"{figures['lost']} requests lost")
    if figures["kv_blocks_leaked"]:
        failures.append(f"{figures['kv_blocks_leaked']} KV blocks still in use when idle")
    if figures["rss_growth"] >= RSS_GROWTH_LIMIT:
        failures.append(f"resident memory grew {figures['rss_growth']:.1%}")
    if figures["malformed_not_4xx"]:
        failures.append(f"{figures['malformed_not_4xx']} malformed requests not refused")
    return failures


if __name__ == "__main__":
    main()
