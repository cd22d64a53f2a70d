"""Distributed inference on this machine's CPU cores: tensor and pipeline parallelism
(gloo, a process per rank, `mp` executor) against one rank, same run, same workload.

The workload is bench/throughput.py's (random prompts of 64 to 512 tokens, 128 greedy
output tokens each, all at once) on a Llama-shaped model of about the default model's
size whose head counts divide by 2 (30 layers, hidden 512, 8 heads and 4 kv heads of 64,
random weights): one rank of 2 threads against TP=2 and PP=2 (2 ranks of 1 thread each);
then the default model (9 heads: no TP=2) at one rank and at PP=2. Tokens must be
identical across the rows of a model. For each row: tokens/s; the communication of a
step (tensor-parallel all-reduces and gathers, pipeline send/recv; a stage's receive
includes its wait for the previous stage), in µs per step and as a share of the step;
and each rank's memory (weights, KV cache bytes per token).

The second table is a worked estimate, not a measurement: Llama-3-70B (80 layers, hidden
8192, bfloat16) on 8 GPUs of an H200 node, TP=8 against TP=4 x PP=2. Each decoder layer
all-reduces the step's hidden states twice (what the first table's all-reduce bytes
show per token: 2 x hidden x 4 bytes in float32, and the embedding's and the logits'
collectives besides); a ring all-reduce over n GPUs moves 2 (n-1)/n of them through
each GPU's link; a pipeline step sends them once per stage boundary. A stage's compute
is the longer of reading its weights (a decode step is HBM-bound) and its FLOPs (2 x
parameters per token; a prefill is compute-bound), and nothing overlaps the
communication (the bound is on the safe side). Published figures
used: H200 HBM3e 4.8 TB/s and 989 dense bfloat16 TFLOP/s (at an assumed 50% of it),
NVLink 4 450 GB/s each way per GPU, InfiniBand NDR 400 Gb/s (50 GB/s) per GPU between
nodes, and an assumed 10 µs latency per collective on NVLink (25 µs over InfiniBand).

The last line printed is one JSON object, also written to bench/results/distributed.json.

    python -m bench.distributed [--num-prompts 32] [--min-len 64] [--max-len 512]
                                [--output-len 128] [--rounds 1] [--no-default-model]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pyengine import LLM, SamplingParams
from pyengine.loader.resolve import DEFAULT_MODEL

from .common import add_workload_arguments, print_table, report

# Llama-shaped, about the default model's size (~120M parameters, tied embeddings),
# heads divisible by 2.
BENCH_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}


@dataclass
class Row:
    name: str
    model: str
    tp: int
    pp: int
    seconds: float
    steps: int
    tp_comm_s: float  # per rank, mean over the ranks
    tp_comm_bytes: float
    pp_comm_s: float
    weight_bytes: int  # per rank, the largest
    kv_bytes_per_token: int  # per rank, the largest
    tokens: list[list[int]]


def run(
    name: str, model: str, tp: int, pp: int, prompts: list[list[int]], params: SamplingParams,
    rounds: int, engine_args: dict[str, Any],
) -> Row:  # fmt: skip
    llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, **engine_args)
    engine, executor = llm.llm_engine, llm.llm_engine.executor
    distributed = tp * pp > 1
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    steps = [0]
    execute_model = executor.execute_model

    def counted(step: Any) -> Any:
        steps[0] += 1
        return execute_model(step)

    executor.execute_model = counted  # type: ignore[method-assign]
    best: Row | None = None
    for _ in range(rounds):
        for scheduler in engine.schedulers:
            scheduler.kv_cache.reset_prefix_cache()  # no hits from the last round
        if distributed:
            executor.collective_rpc(("comm_stats",))  # type: ignore[attr-defined]  # resets
        steps[0] = 0
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        comm = executor.collective_rpc(("comm_stats",)) if distributed else []  # type: ignore[attr-defined]
        if best is not None and seconds >= best.seconds:
            continue
        ranks = executor.ranks if distributed else [executor.driver_worker.describe()]  # type: ignore[attr-defined]
        mean = lambda values: float(np.mean(values)) if values else 0.0  # noqa: E731
        best = Row(
            name, model, tp, pp, seconds, steps[0],
            tp_comm_s=mean([c["tp"][0] for c in comm]),
            tp_comm_bytes=mean([c["tp"][2] for c in comm]),
            pp_comm_s=mean([c["pp"][0] for c in comm]),
            weight_bytes=max(int(d["weight_bytes"]) for d in ranks),
            kv_bytes_per_token=max(int(d["block_bytes"]) for d in ranks) // 16,
            tokens=[list(o.outputs[0].token_ids) for o in outputs],
        )  # fmt: skip
    engine.shutdown()
    assert best is not None
    return best


def share(part_s: float, row: Row) -> str:
    if not part_s:
        return "-"
    return f"{part_s / row.steps * 1e6:,.0f} ({part_s / row.seconds:.1%})"


# -- the worked estimate: Llama-3-70B on an 8-GPU H200 node ---------------------------

LAYERS, HIDDEN, PARAMS, BF16 = 80, 8192, 70.6e9, 2
HBM, FLOPS, NVLINK, INFINIBAND = 4.8e12, 989e12 * 0.5, 450e9, 50e9
NVLINK_LATENCY, IB_LATENCY = 10e-6, 25e-6


def estimate(tp: int, pp: int, tokens: int, pp_link: float, pp_latency: float) -> dict[str, float]:
    """Seconds of one step of `tokens` tokens through the whole model: the weights read
    (each stage in turn), the all-reduces, the transfers between stages."""
    per_gpu = PARAMS / (tp * pp)
    stage = max(per_gpu * BF16 / HBM, 2 * per_gpu * tokens / FLOPS)
    compute = stage * pp  # a step passes every stage in turn
    payload = tokens * HIDDEN * BF16
    ring = 2 * (tp - 1) / tp * payload / NVLINK + NVLINK_LATENCY
    all_reduce = 2 * LAYERS * ring if tp > 1 else 0.0
    transfers = (pp - 1) * (payload / pp_link + pp_latency)
    step = compute + all_reduce + transfers
    # With pp steps in flight every stage is busy: a step leaves every step / pp.
    return {"step": step, "comm": all_reduce + transfers, "interval": step / pp}


def estimate_rows() -> list[tuple[str, ...]]:
    rows = []
    setups = [("TP=8", 8, 1, NVLINK, NVLINK_LATENCY),
              ("TP=4 x PP=2, one node (NVLink)", 4, 2, NVLINK, NVLINK_LATENCY),
              ("TP=4 x PP=2, two nodes (InfiniBand)", 4, 2, INFINIBAND, IB_LATENCY)]  # fmt: skip
    for tokens in (64, 8192):
        for name, tp, pp, link, latency in setups:
            e = estimate(tp, pp, tokens, link, latency)
            rows.append((
                f"{name}, {tokens} tokens a step", f"{e['step'] * 1e3:.2f}",
                f"{e['comm'] * 1e3:.2f}", f"{e['comm'] / e['step']:.0%}",
                f"{tokens / e['interval']:,.0f}",
            ))  # fmt: skip
    return rows


def main() -> None:
    parser = add_workload_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--rounds", type=int, default=1, help="best of this many, each row")
    parser.add_argument("--no-default-model", action="store_true")
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_len, args.max_len + 1, args.num_prompts)
    prompts = [rng.integers(100, 49000, n).tolist() for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engine_args: dict[str, Any] = dict(max_model_len=args.max_len + args.output_len + 16,
                                       seed=args.seed)  # fmt: skip
    folder = Path(tempfile.mkdtemp(prefix="pyengine-bench-"))
    (folder / "config.json").write_text(json.dumps(BENCH_MODEL))
    shaped = str(folder)
    dummy = dict(engine_args, load_format="dummy")
    splits = (("TP=1 (2 threads)", 1, 1), ("TP=2", 2, 1), ("PP=2", 1, 2))
    rows = [run(name, shaped, tp, pp, prompts, params, args.rounds, dummy)
            for name, tp, pp in splits]  # fmt: skip
    if not args.no_default_model:
        for name, tp, pp in (("default model, TP=1", 1, 1), ("default model, PP=2", 1, 2)):
            rows.append(run(name, DEFAULT_MODEL, tp, pp, prompts, params, args.rounds, engine_args))

    generated = args.num_prompts * args.output_len
    total = generated + int(lengths.sum())
    reference = {row.model: row for row in reversed(rows) if row.tp * row.pp == 1}
    table = []
    figures: dict[str, Any] = {}
    for row in rows:
        base = reference[row.model]
        same = row.tokens == base.tokens
        table.append((
            row.name, f"{row.tp * row.pp} x {2 // (row.tp * row.pp)}",
            f"{generated / row.seconds:.1f}", f"{total / row.seconds:.1f}",
            f"{base.seconds / row.seconds:.2f}x", share(row.tp_comm_s, row),
            share(row.pp_comm_s, row), f"{row.weight_bytes / 2**20:.0f}",
            f"{row.kv_bytes_per_token / 1024:.1f}", "yes" if same else "NO",
        ))  # fmt: skip
        key = row.name.replace("default model, ", "default_").replace("=", "").split(" ")[0]
        key = key.lower().replace(",", "")
        figures[f"{key}_generated_tok_s"] = round(generated / row.seconds, 1)
        figures[f"{key}_tokens_identical"] = same
        if row.tp_comm_s:
            figures[f"{key}_allreduce_share"] = round(row.tp_comm_s / row.seconds, 4)
            figures[f"{key}_allreduce_us_per_step"] = round(row.tp_comm_s / row.steps * 1e6)
            figures[f"{key}_allreduce_bytes_per_token_layer"] = round(
                row.tp_comm_bytes / (total * BENCH_MODEL["num_hidden_layers"])  # type: ignore[operator]
            )
        if row.pp_comm_s:
            figures[f"{key}_sendrecv_share"] = round(row.pp_comm_s / row.seconds, 4)
    tables = [
        print_table(
            (
                "run",
                "ranks x threads",
                "generated tok/s",
                "total tok/s",
                "vs one rank",
                "all-reduce µs/step (share)",
                "send/recv µs/step (share)",
                "weights MiB/rank",
                "KV KiB/token/rank",
                "tokens as one rank",
            ),
            table,
        ),  # fmt: skip
        print_table(
            ("Llama-3-70B, 8 H200 (estimate)", "step ms", "communication ms", "share", "tokens/s"),
            estimate_rows(),
        ),  # fmt: skip
    ]
    figures["tp2_speedup_vs_tp1"] = round(rows[0].seconds / rows[1].seconds, 3)
    figures["pp2_speedup_vs_tp1"] = round(rows[0].seconds / rows[2].seconds, 3)
    report("distributed", figures, tables=tables)


if __name__ == "__main__":
    main()
