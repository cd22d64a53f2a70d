"""What the benchmarks share: table printing, timing, and their results.

Every benchmark ends with report(): it writes bench/results/<name>.json (its figures, the
tables it printed, the command, the date and the machine) and prints the figures as one
JSON object, the last line of its output. `python -m bench.docs` turns those files into
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"

T = TypeVar("T")


def print_table(
    header: tuple[str, ...], rows: Sequence[tuple[str, ...]], num_text_columns: int = 1
) -> str:
    """Prints a markdown table, the first num_text_columns left-aligned, figures
    right-aligned; returns its text (for report()'s `tables`)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        padded = [
            c.ljust(w) if i < num_text_columns else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = [
        "-" * (w + 2) if i < num_text_columns else "-" * (w + 1) + ":" for i, w in enumerate(widths)
    ]
    text = "\n".join([line(header), "|" + "|".join(rule) + "|", *(line(row) for row in rows)])
    print(text)
    return text


def timings(repeats: int, fn: Callable[[], T]) -> tuple[list[float], T]:
    """Sorted wall times (seconds, time.perf_counter) of `repeats` calls, and the last
    call's result."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return sorted(times), result


def best_time(fn: Callable[[], object], min_repeats: int = 5, min_seconds: float = 0.3) -> float:
    """The fastest of at least `min_repeats` calls lasting `min_seconds` in all, after one
    untimed warm-up call."""
    fn()  # warm up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def last_level_cache_bytes() -> int:
    """The size of the largest CPU cache Linux reports (0 where it reports none)."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=0)


def cold_best_time(fn: Callable[[], object], min_repeats: int = 5) -> float:
    """The fastest of `min_repeats` calls, each after a read of twice the last-level cache
    (at least 256 MiB), so that what `fn` reads comes from memory, as a decode step's
    KV cache does in a server whose caches hold many requests' blocks."""
    import torch  # (here: the module serves benchmarks without torch too)

    flush = torch.ones(max(2 * last_level_cache_bytes(), 2**28) // 4)
    fn()  # warm up
    times = []
    for _ in range(min_repeats):
        flush.sum()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str | None:
    """The checkout's commit (with "-dirty" if it has changes), or None outside git."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=BENCH, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine(device: str | None = None) -> dict[str, Any]:
    """Where the figures come from: the CPU, its cores, the load when they were taken (the
    machine may be shared), and `device` (a GPU's name) for GPU runs."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    if device is not None:
        info["device"] = device
    settings = {k: v for k, v in sorted(os.environ.items()) if k.startswith("PYENGINE_")}
    if settings:
        info["environment"] = settings
    return info


def command() -> str:
    """How this benchmark was run: `python -m bench.<name> <arguments>`."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    program = f"python -m {spec.name}" if spec is not None else f"python {sys.argv[0]}"
    return " ".join([program, *sys.argv[1:]])


def report(
    name: str,
    figures: Mapping[str, Any],
    *,
    tables: Sequence[str] = (),
    device: str | None = None,
) -> Path:
    """Writes bench/results/<name>.json and prints `figures` as one JSON object (the last
    line the benchmark prints). `tables` are the markdown tables it printed (from
    print_table), `device` the GPU's name for a GPU run. Returns the file written."""
    module = getattr(getattr(sys.modules["__main__"], "__spec__", None), "name", None)
    result = {
        "benchmark": name,
        "module": module,
        "command": command(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": machine(device),
        "tables": list(tables),
        "figures": dict(figures),
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(f"(figures written to {path})")
    print(json.dumps(figures))
    return path


def add_workload_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of bench/throughput.py's workload (random prompts of --min-len to
    --max-len tokens, --output-len greedy tokens each), which the CPU benchmarks share."""
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    return parser
