"""The second part of bench/soak.py: the KV host tier on and off on a prefix-heavy
workload (prefixes that together exceed a small device pool, asked for round-robin):
prompt tokens, cached ones, prefill tokens computed, TTFT at p50."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .common import print_table
from .soak_load import Outcome, Record, exchange, get, parse_metrics
from .soak_server import Server, launch, log_tail
from .soak_workload import Mix, Workload


@dataclass(frozen=True)
class TierConfig:
    tenants: int = 8
    prefix_words: int = 400
    rounds: int = 4
    concurrency: int = 2
    device_kv_mib: int = 64  # the shared prefixes must exceed it
    offload_gb: float = 1.0
    offload_dir: str | None = None


HITS = "pyengine:prefix_cache_hits_total"  # tokens found cached, by tier (device, host)


@dataclass(frozen=True)
class TierRun:
    label: str
    requests: int
    prompt_tokens: int  # /metrics
    # Prompt tokens found cached: /metrics where the server counts them (by tier), else
    # the answers' usage.prompt_tokens_details.
    cached_tokens: int
    host_cached_tokens: int | None  # None: the server does not count the tiers apart
    ttft_p50_s: float | None
    failed: int  # requests without a whole answer

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def increase(before: dict[str, float], after: dict[str, float], name: str, label: str) -> int:
    """A counter's increase, summed over its series whose labels include `label`."""
    keys = [k for k in after if k.startswith(name + "{") and label in k]
    return int(sum(after[k] - before.get(k, 0.0) for k in keys))


async def tier_workload(server: Server, workload: Workload, cfg: TierConfig) -> list[Record]:
    """Each tenant's long prefix and a unique question, round-robin over the tenants
    (the least recently used prefix is the next one asked for), a few at a time."""
    limit = asyncio.Semaphore(cfg.concurrency)
    prefixes = [workload.words(cfg.prefix_words, f"tier tenant {t}") for t in range(cfg.tenants)]
    calls = [
        workload.tier_call(i, prefixes[i % cfg.tenants]) for i in range(cfg.tenants * cfg.rounds)
    ]
    records = [Record("plain") for _ in calls]

    async def one(i: int) -> None:
        async with limit:
            await exchange(server.port, calls[i], records[i])

    await asyncio.gather(*(one(i) for i in range(len(records))))
    return records


def tier_run(cfg: TierConfig, offload: bool, log_dir: Path, model: str | None) -> TierRun:
    options = ["--kv-cache-memory", str(cfg.device_kv_mib << 20), "--max-num-seqs",
               str(cfg.concurrency)]  # fmt: skip
    if offload:
        options += ["--kv-offload-gb", str(cfg.offload_gb)]
        if cfg.offload_dir is not None:
            options += ["--kv-offload-dir", cfg.offload_dir]
    label = "on" if offload else "off"
    server = launch(model, 1024, options, log_dir / f"tier-{label}-server.log")
    # Same seed both times: the same prefixes and questions.
    workload = Workload(server.model_name, Mix(), np.random.default_rng(1), 0.0)
    try:

        async def measure() -> tuple[list[Record], dict[str, float], dict[str, float]]:
            await exchange(server.port, workload.probe_call(), Record("plain"))  # warm up
            before = parse_metrics((await get(server.port, "/metrics"))[1].decode())
            records = await tier_workload(server, workload, cfg)
            after = parse_metrics((await get(server.port, "/metrics"))[1].decode())
            return records, before, after

        records, before, after = asyncio.run(measure())
    except BaseException:
        print(f"the server's log ends:\n{log_tail(server.log)}", file=sys.stderr)
        raise
    finally:
        server.stop()
    pool_tokens = server.num_blocks * server.block_size
    prefix_tokens = cfg.tenants * max((r.prompt_tokens for r in records), default=0)
    print(f"KV host tier {label}: device pool {pool_tokens} tokens, prefixes ~{prefix_tokens}")
    ok = [r for r in records if r.outcome is Outcome.COMPLETED]
    for r in [r for r in records if r.outcome is not Outcome.COMPLETED][:3]:
        print(f"  failed: {r.outcome.value if r.outcome else ''} {r.status} {r.detail[:200]}")
    ttft = [r.ttft for r in ok if r.ttft is not None]
    by_tier = any(k.startswith(HITS + "{") for k in after)
    cached = increase(before, after, HITS, "") if by_tier else sum(r.cached_tokens for r in ok)
    return TierRun(
        label, len(records),
        increase(before, after, "pyengine:prompt_tokens_total", ""), cached,
        increase(before, after, HITS, 'tier="host"') if by_tier else None,
        float(np.percentile(ttft, 50)) if ttft else None,
        sum(r.outcome is not Outcome.COMPLETED for r in records),
    )  # fmt: skip


def print_tier(
    runs: list[TierRun] | None, cfg: TierConfig, skipped: str
) -> tuple[list[str], dict[str, Any]]:
    if runs is None:
        print(f"\nKV host tier on and off: skipped ({skipped})")
        return [], {"tier_skipped": skipped}
    print(
        f"\n# KV host tier on and off: {cfg.tenants} prefixes of {cfg.prefix_words} words, "
        f"{cfg.rounds} rounds of one request each, round-robin, {cfg.concurrency} at a time, "
        f"device KV pool {cfg.device_kv_mib} MiB\n"
    )
    table = print_table(
        ("KV host tier", "prompt tokens", "cached", "from the host tier", "prefill computed",
         "TTFT p50 (ms)", "failed"),
        [(r.label, str(r.prompt_tokens), str(r.cached_tokens),
          "-" if r.host_cached_tokens is None else str(r.host_cached_tokens), str(r.computed),
          "-" if r.ttft_p50_s is None else f"{r.ttft_p50_s * 1000:.0f}", str(r.failed))
         for r in runs],
    )  # fmt: skip
    figures: dict[str, Any] = {}
    for r in runs:
        figures[f"tier_{r.label}_prefill_computed_tokens"] = r.computed
        figures[f"tier_{r.label}_cached_tokens"] = r.cached_tokens
        figures[f"tier_{r.label}_host_cached_tokens"] = r.host_cached_tokens
        figures[f"tier_{r.label}_ttft_p50_s"] = None if r.ttft_p50_s is None else round(
            r.ttft_p50_s, 3)  # fmt: skip
    return [table], figures
