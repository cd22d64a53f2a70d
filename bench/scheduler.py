"""Scheduler benchmark: pyengine's C++ Scheduler against a pure-Python peer.

Both run in this process, without prefix caching (the peer is bench/reference/scheduler.py,
written the way vLLM v1's Python scheduler is, with its own pure-Python block allocator):

  a) decode steps: n = 64, 256 and 1024 requests with 112-144-token prompts and
     max_tokens=10,000 (ignore_eos) are stepped until every one decodes; then each timed
     step is schedule() + update(sampled), where `sampled` is the fake model's output for
     the step ((step + row) % 32000, made beforehand). The pool is large enough that nothing
     is preempted. Reported: µs per step, the best of R rounds of K steps.
  b) cross-check (untimed): small random workloads on a pool small enough to preempt often
     (with chunked prefill, a long-prefill threshold, and without chunked prefill), driven
     by a deterministic fake model (next token = (sum of the last 3 tokens * 31 + 7) % 1000)
     with EOS, stop tokens, min_tokens, max_tokens, max_model_len and aborts. Every
     request's output and finish reason must equal a direct generation from its prompt, and
     both schedulers must produce the same outputs, the same step-by-step schedule and
     (since both hand out blocks in the same order) the same block ids.

The last line printed is one JSON object, also written to bench/results/scheduler.json.
tests/core/test_reference_equivalence.py asserts the cross-check's equalities.

    python -m bench.scheduler [--python-only] [--quick] [--steps K] [--rounds R]

(from the repository root; bench/__init__.py says how with a plain install)
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .common import print_table, report
from .reference.scheduler import NO_TOKEN, FinishReason, PyScheduler

BLOCK_SIZE = 16
VOCAB_SIZE = 32000
SIZES = (64, 256, 1024)
MAX_NUM_BATCHED_TOKENS = 8192

MakeScheduler = Callable[..., Any]  # pyengine.Scheduler or PyScheduler


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------- decode steps


def decoding_scheduler(make: MakeScheduler, n: int, num_steps: int, seed: int) -> Any:
    """A scheduler holding n requests, stepped until all of them decode, with room for
    `num_steps` more tokens each."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(112, 145))] for _ in range(n)
    ]
    num_prefill_steps = cdiv(144 * n, MAX_NUM_BATCHED_TOKENS) + 1
    num_blocks = n * cdiv(144 + num_prefill_steps + num_steps + 1, BLOCK_SIZE)
    scheduler = make(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=False,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=n,
        max_model_len=4096,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=0,
        policy="fcfs",
    )
    for i, prompt in enumerate(prompts):
        scheduler.add_request(f"req-{i}", prompt, max_tokens=10_000, ignore_eos=True)
    for _ in range(num_prefill_steps):
        scheduler.schedule()
        b = scheduler.buffers
        num_sampled = len(b.logits_indices)
        all_decoding = num_sampled == n and b.num_tokens == n
        scheduler.update(np.arange(num_sampled, dtype=np.int32) % VOCAB_SIZE)
        if all_decoding:
            return scheduler
    raise RuntimeError(f"{n} requests are not all decoding after {num_prefill_steps} steps")


def time_decode(make: MakeScheduler, n: int, steps: int, rounds: int, seed: int) -> float:
    """µs per schedule() + update() step with n decoding requests, best of `rounds`."""
    warmup = 20
    scheduler = decoding_scheduler(make, n, warmup + steps * rounds, seed)
    # The fake model's output, one row per step, built untimed.
    sampled = list(((np.arange(steps)[:, None] + np.arange(n)) % VOCAB_SIZE).astype(np.int32))
    for k in range(warmup):
        scheduler.schedule()
        scheduler.update(sampled[k % steps])
    # Setup objects are frozen out of the cyclic GC, as a serving engine does after start-up.
    gc.collect()
    gc.freeze()
    best = float("inf")
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            for k in range(steps):
                scheduler.schedule()
                scheduler.update(sampled[k])  # raises unless exactly n rows sampled
            best = min(best, (time.perf_counter() - start) / steps)
    finally:
        gc.unfreeze()
    stats = scheduler.stats()
    if stats.num_preemptions != 0 or stats.num_running != n:
        raise RuntimeError(
            f"n={n}: {stats.num_preemptions} preemptions, {stats.num_running} running"
        )
    return best * 1e6


# ---------------------------------------------------------------------------- cross-check

CHECK_VOCAB_SIZE = 1000
# Each pool holds a few max_model_len requests (160 tokens = 10 blocks): preemption is common.
CHECK_CONFIGS: list[dict[str, Any]] = [
    {"num_blocks": 24, "max_num_batched_tokens": 64, "max_num_seqs": 8},
    {
        "num_blocks": 20,
        "max_num_batched_tokens": 48,
        "max_num_seqs": 16,
        "long_prefill_token_threshold": 24,
    },
    {
        "num_blocks": 20,
        "max_num_batched_tokens": 160,
        "max_num_seqs": 16,
        "enable_chunked_prefill": False,
    },
    # A hybrid model's: fewer recurrent-state slots than running requests.
    {"num_blocks": 24, "max_num_batched_tokens": 64, "max_num_seqs": 8, "num_state_slots": 3},
]
CHECK_MAX_MODEL_LEN = 160
ABORT_STEP = 15


def fake_model(token_ids: list[int]) -> int:
    return (sum(token_ids[-3:]) * 31 + 7) % CHECK_VOCAB_SIZE


@dataclass(frozen=True)
class CheckRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # add_request keyword arguments
    add_at_step: int


@dataclass
class CheckRun:
    outputs: dict[str, tuple[list[int], int]]  # request id -> (output tokens, finish reason)
    schedule_trace: list[Any]  # per step: ids, token counts, input ids, positions, ...
    block_trace: list[Any]  # per step: slot_mapping and each row's used block-table entries
    num_preemptions: int


def reference_output(request: CheckRequest) -> tuple[list[int], int]:
    """What the request must produce: the fake model run on it alone."""
    p = request.params
    token_ids = list(request.prompt_token_ids)
    output: list[int] = []
    while True:
        token = fake_model(token_ids)
        token_ids.append(token)
        output.append(token)
        if len(output) >= p["min_tokens"] and (
            (token == p["eos_token_id"] and not p["ignore_eos"]) or token in p["stop_token_ids"]
        ):
            return output, FinishReason.STOP
        if len(output) >= p["max_tokens"] or len(token_ids) >= CHECK_MAX_MODEL_LEN:
            return output, FinishReason.LENGTH


def make_check_workload(num_requests: int, seed: int) -> list[CheckRequest]:
    """Random prompts and limits; EOS and stop tokens are drawn from each request's own
    future output, so that they fire (or are held back by min_tokens)."""
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        prompt = [rng.randrange(CHECK_VOCAB_SIZE) for _ in range(rng.randrange(1, 101))]
        max_tokens = rng.randrange(1, 81)
        params: dict[str, Any] = {
            "max_tokens": max_tokens,
            "min_tokens": 0,
            "eos_token_id": None,
            "stop_token_ids": [],
            "ignore_eos": rng.random() < 0.2,
            "arrival_time": 0.0,
        }
        future, _ = reference_output(CheckRequest("", prompt, params, 0))
        if rng.random() < 0.5:
            params["eos_token_id"] = rng.choice(future)
        if rng.random() < 0.3:
            params["stop_token_ids"] = [rng.choice(future), rng.randrange(CHECK_VOCAB_SIZE)]
        if rng.random() < 0.3:
            params["min_tokens"] = rng.randrange(max_tokens + 1)
        add_at_step = 0 if rng.random() < 0.5 else rng.randrange(1, 60)
        # Ties keep submission order; some late requests claim an earlier arrival, so that
        # admission order and policy order differ (a preemption victim may come first).
        params["arrival_time"] = float(rng.randrange(10) - rng.choice((0, add_at_step)))
        requests.append(CheckRequest(f"chk-{i}", prompt, params, add_at_step))
    return requests


def drive(make: MakeScheduler, config: dict[str, Any], workload: list[CheckRequest]) -> CheckRun:
    """Runs a workload to the end with the fake model, recording every step's inputs."""
    scheduler = make(
        block_size=BLOCK_SIZE,
        enable_prefix_caching=False,
        max_model_len=CHECK_MAX_MODEL_LEN,
        policy="fcfs",
        **({"enable_chunked_prefill": True, "long_prefill_token_threshold": 0} | config),
    )
    pending = sorted(workload, key=lambda r: r.add_at_step)
    num_prompt_tokens = {r.request_id: len(r.prompt_token_ids) for r in workload}
    abort_ids = [r.request_id for r in workload[3::10]]
    token_ids: dict[str, list[int]] = {}
    reasons: dict[str, int] = {}
    schedule_trace: list[Any] = []
    block_trace: list[Any] = []
    step = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0].add_at_step <= step:
            request = pending.pop(0)
            scheduler.add_request(request.request_id, request.prompt_token_ids, **request.params)
            token_ids[request.request_id] = list(request.prompt_token_ids)
        if step == ABORT_STEP:
            for request_id in abort_ids:
                if request_id in token_ids and request_id not in reasons:
                    scheduler.abort_request(request_id)
                    reasons[request_id] = FinishReason.ABORT
        scheduler.schedule()
        b = scheduler.buffers
        ids = list(b.request_ids)
        rows = [row for row, sampling in enumerate(b.is_sampling.tolist()) if sampling]
        sampled = np.array([fake_model(token_ids[ids[row]]) for row in rows], dtype=np.int32)
        arrays = (b.num_scheduled_tokens, b.query_start_loc, b.input_ids, b.positions,
                  b.state_slots, b.has_state)  # fmt: skip
        schedule_trace.append(
            (ids, *(a.tolist() for a in arrays), b.seq_lens.tolist(), b.logits_indices.tolist())
        )
        # Block-table entries past a request's blocks are not compared (zeros or stale).
        used = [cdiv(seq_len, BLOCK_SIZE) for seq_len in b.seq_lens.tolist()]
        tables = [table[:k] for table, k in zip(b.block_tables.tolist(), used, strict=True)]
        block_trace.append((b.slot_mapping.tolist(), tables))
        scheduler.update(sampled)
        results = scheduler.results
        new_token_ids = results.new_token_ids.tolist()
        finish_reasons = results.finish_reasons.tolist()
        for request_id, token, reason in zip(ids, new_token_ids, finish_reasons, strict=True):
            if token != NO_TOKEN:
                token_ids[request_id].append(token)
            if reason != FinishReason.NONE:
                reasons[request_id] = reason
        step += 1
        if step > 100_000:
            raise RuntimeError("the check workload makes no progress")
    outputs = {
        request_id: (tokens[num_prompt_tokens[request_id] :], reasons[request_id])
        for request_id, tokens in token_ids.items()
    }
    return CheckRun(outputs, schedule_trace, block_trace, scheduler.stats().num_preemptions)


def matches_reference(run: CheckRun, workload: list[CheckRequest]) -> bool:
    """Finished requests produced exactly the reference; aborted ones a prefix of it."""
    for request in workload:
        output, reason = run.outputs[request.request_id]
        reference, reference_reason = reference_output(request)
        if reason == FinishReason.ABORT:
            if reference[: len(output)] != output:
                return False
        elif (output, reason) != (reference, reference_reason):
            return False
    return True


def cross_check(makers: dict[str, MakeScheduler], seed: int) -> dict[str, Any]:
    """Both schedulers (or the Python one alone) over every check configuration."""
    summary: dict[str, Any] = {"workloads": len(CHECK_CONFIGS), "requests": 0}
    runs: dict[str, list[CheckRun]] = {name: [] for name in makers}
    for i, config in enumerate(CHECK_CONFIGS):
        workload = make_check_workload(40, seed + i)
        summary["requests"] += len(workload)
        for name, make in makers.items():
            run = drive(make, config, workload)
            runs[name].append(run)
            key = f"{name}_matches_reference"
            summary[key] = summary.get(key, True) and matches_reference(run, workload)
    for name, name_runs in runs.items():
        summary[f"{name}_preemptions"] = sum(r.num_preemptions for r in name_runs)
    if "cpp" in runs:
        pairs = list(zip(runs["cpp"], runs["python"], strict=True))
        summary["outputs_match"] = all(
            {k: v[0] for k, v in c.outputs.items()} == {k: v[0] for k, v in p.outputs.items()}
            for c, p in pairs
        )
        summary["finish_reasons_match"] = all(c.outputs == p.outputs for c, p in pairs)
        summary["schedules_match"] = all(c.schedule_trace == p.schedule_trace for c, p in pairs)
        summary["block_ids_match"] = all(c.block_trace == p.block_trace for c, p in pairs)
    return summary


# ---------------------------------------------------------------------------- report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-only", action="store_true", help="skip the C++ scheduler")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds")
    parser.add_argument("--steps", type=int, help="timed steps per round (default 200)")
    parser.add_argument("--rounds", type=int, help="rounds, the best counts (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    steps = args.steps or (50 if args.quick else 200)
    rounds = args.rounds or (2 if args.quick else 5)

    makers: dict[str, MakeScheduler] = {}
    if not args.python_only:
        import pyengine

        if not hasattr(pyengine, "Scheduler"):
            parser.error("this pyengine has no Scheduler binding yet; run with --python-only")
        makers["cpp"] = pyengine.Scheduler
    makers["python"] = PyScheduler

    us = {
        name: {n: time_decode(make, n, steps, rounds, args.seed) for n in SIZES}
        for name, make in makers.items()
    }
    cpp_us = us.get("cpp", {})
    speedup = {n: us["python"][n] / cpp_us[n] for n in cpp_us}
    check = cross_check(makers, args.seed)

    print("# Scheduler: pyengine C++ vs pure Python (vLLM-style), no prefix caching")
    print(
        f"one step = schedule() + update(sampled) with n decoding requests; "
        f"best of {rounds} rounds of {steps} steps\n"
    )
    rows = [
        (
            str(n),
            f"{cpp_us[n]:.1f}" if n in cpp_us else "-",
            f"{us['python'][n]:.1f}",
            f"{speedup[n]:.1f}x" if n in speedup else "-",
        )
        for n in SIZES
    ]
    table = print_table(("running requests", "C++ µs/step", "Python µs/step", "speedup"), rows)
    print()
    preemptions = ", ".join(f"{name} {check[f'{name}_preemptions']}" for name in makers)
    print(
        f"cross-check: {check['workloads']} workloads, {check['requests']} requests, "
        f"preemptions: {preemptions}"
    )
    for name in makers:
        ok = check[f"{name}_matches_reference"]
        print(f"  {name}: outputs equal the fake model run alone: {ok}")
    if "cpp" in makers:
        for key in ("outputs_match", "finish_reasons_match", "schedules_match", "block_ids_match"):
            print(f"  C++ vs Python, {key.replace('_', ' ')}: {check[key]}")
    else:
        print("  C++ vs Python: skipped (--python-only)")

    figures: dict[str, Any] = {}
    for n in SIZES:
        figures[f"us_per_step_{n}"] = round(cpp_us[n], 2) if n in cpp_us else None
        figures[f"python_us_per_step_{n}"] = round(us["python"][n], 1)
        figures[f"speedup_vs_python_{n}"] = round(speedup[n], 1) if n in speedup else None
    has_cpp = "cpp" in makers
    figures["target_under_100us_at_256"] = cpp_us[256] < 100.0 if has_cpp else None
    figures["target_20x"] = speedup[256] >= 20.0 if has_cpp else None
    figures["min_speedup_vs_python"] = round(min(speedup.values()), 1) if has_cpp else None
    figures["cross_check_outputs_match"] = check.get("outputs_match")
    figures["cross_check_schedules_match"] = check.get("schedules_match")
    figures["python_matches_reference"] = check["python_matches_reference"]
    figures["cpp_matches_reference"] = check.get("cpp_matches_reference")
    report("scheduler", figures, tables=[table])


if __name__ == "__main__":
    main()
