"""Where a recorded CPU decode step's time goes: each kernel of the one-request program
timed call by call (KernelProgram.profile), summed by kernel, against the step replayed
whole (KernelProgram.run) and the memory-bandwidth bound of the weights it streams; and
the LM head, which runs after the program.

Timing each call adds its clock reads and ends the overlap of one call's tail with the
next one's start, so the sum of the calls can differ from the whole replay either way;
OpenMP's fork, join and imbalance sit inside the calls. The
step replays the inputs of the last decode of a real request, its context as long as
that request's.

    python -m bench.decode_profile [--model PATH] [--quantized-activations int8]
                                   [--kv-cache-dtype float16] [--context 384]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
import torch

from pyengine import LLM, SamplingParams
from pyengine.layers.vocab_embedding import ParallelLMHead
from pyengine.loader.resolve import DEFAULT_MODEL

from .common import best_time, print_table, report
from .throughput import read_bandwidth, single_decode_weight_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--quantized-activations", default="int8")
    parser.add_argument("--kv-cache-dtype", default="float16")
    parser.add_argument("--context", type=int, default=384, help="prompt + generated tokens")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()

    prompt = np.random.default_rng(0).integers(100, 49_000, args.context // 2).tolist()
    llm = LLM(
        args.model, max_model_len=args.context + 16,
        quantized_activations=args.quantized_activations, kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.context - len(prompt), ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    if runner.graphs is None or 1 not in runner.graphs.programs:
        raise SystemExit("this model's decode steps run eagerly: there is no program to profile")
    program = runner.graphs.programs[1]

    program.profile(10)  # warm
    calls = program.profile(args.repeats)
    start = time.perf_counter()
    for _ in range(args.repeats):
        program.run()
    whole = (time.perf_counter() - start) / args.repeats
    hidden = runner.graphs.hidden[1]
    head_seconds = best_time(lambda: runner.model.compute_logits(hidden))
    heads = [m for m in runner.model.modules() if isinstance(m, ParallelLMHead)]
    head_bytes = sum(single_decode_weight_bytes(h) for h in heads)
    streamed = single_decode_weight_bytes(runner.model) - head_bytes
    bandwidth = read_bandwidth()

    by_kernel: dict[str, list[float]] = defaultdict(list)
    for name, seconds in calls:
        by_kernel[name].append(seconds)
    summed = sum(seconds for _, seconds in calls)
    rows = [
        (name, str(len(times)), f"{sum(times) * 1e6:.0f}", f"{sum(times) / summed:.1%}",
         f"{np.mean(times) * 1e6:.1f}")
        for name, times in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))
    ]  # fmt: skip
    print(
        f"# Recorded decode step, 1 request: {args.model}, context {args.context}, "
        f"{args.quantized_activations} activations, {args.kv_cache_dtype} KV cache, "
        f"{torch.get_num_threads()} threads, mean of {args.repeats}\n"
    )
    table = print_table(("kernel", "calls", "us per step", "share", "us per call"), rows)
    print(
        f"\nsum of the calls {summed * 1e6:.0f} us; the step replayed whole {whole * 1e6:.0f} us; "
        f"the bound of its {streamed / 1e6:.0f} MB of weights at {bandwidth / 1e9:.1f} GB/s: "
        f"{streamed / bandwidth * 1e6:.0f} us. The LM head, run eagerly after the program "
        f"(best of several): "
        f"{head_seconds * 1e6:.0f} us (its {head_bytes / 1e6:.0f} MB: "
        f"{head_bytes / bandwidth * 1e6:.0f} us)"
    )
    figures: dict[str, object] = {
        "program_calls": len(calls),
        "sum_of_calls_us": round(summed * 1e6, 1),
        "replay_us": round(whole * 1e6, 1),
        "program_weight_bound_us": round(streamed / bandwidth * 1e6, 1),
        "lm_head_us": round(head_seconds * 1e6, 1),
        "lm_head_weight_bound_us": round(head_bytes / bandwidth * 1e6, 1),
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 1),
    }
    for name, times in by_kernel.items():
        figures[f"{name}_us"] = round(sum(times) * 1e6, 1)
    llm.llm_engine.shutdown()
    report("decode_profile", figures, tables=[table])


if __name__ == "__main__":
    main()
