"""Offline throughput on a CUDA GPU: pyengine against Hugging Face transformers `generate`
in the same run, on a Llama-3-8B-shaped model with random weights (load_format="dummy";
both engines random, the same architecture and shapes), bfloat16, the same prompts of
random token ids, a fixed number of greedy output tokens each (ignore_eos).

    python -m bench.gpu.throughput [--num-prompts 256] [--prompt-len 512]
                                   [--output-len 256] [--hf-batch 256] [--no-hf]
                                   [--profile]

(bench/gpu/run.sh runs it; bench/__init__.py says how from a checkout.) The last line
printed is one JSON object, also written to bench/results/gpu_throughput.json.

--profile adds, after the measurements, torch.profiler's tables of the GPU time per kernel
and the share of the wall time the GPU was busy, for the two phases apart: a prefill
(64 fresh prompts, one output token each) and decode steps (the same prompts again, their
prefixes cached, 32 output tokens each).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pyengine import LLM, SamplingParams

from ..common import print_table, report
from .kernels import copy_bandwidth, cuda_time
from .roofline import Workload, matmul_flop_s, roofline

LLAMA3_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def run_hf(prompts: list[list[int]], output_len: int, batch: int) -> float:
    """Seconds for transformers to generate output_len tokens for every prompt, in static
    batches (the prompts are of one length: no padding)."""
    import transformers

    config = transformers.LlamaConfig(**LLAMA3_8B)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()

    def generate(model: torch.nn.Module, group: list[list[int]], new_tokens: int) -> None:
        ids = torch.tensor(group, device="cuda")
        out = model.generate(  # type: ignore[operator]
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert out.shape[1] == ids.shape[1] + new_tokens

    with torch.inference_mode():
        generate(model, prompts[:2], 4)  # warm up
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            generate(model, prompts[i : i + batch], output_len)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return seconds


def profile_run(llm: LLM, prompts: list[list[int]], output_len: int, phase: str) -> None:
    """Prints where a run's GPU time goes, kernel by kernel, and how much of its wall time
    the GPU had work (the rest: the host between kernels and steps)."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    print(f"== profiled {phase}: {len(prompts)} prompts, {output_len} output tokens each")
    print(events.table(sort_by="device_time_total", row_limit=15))
    # Kernels only (self time on the device), so that nested ops are not counted twice.
    busy = sum(e.self_device_time_total for e in events) / 1e6
    print(f"{phase}: {wall:.2f} s wall, GPU busy {busy:.2f} s ({busy / wall:.0%})")


def profile_phases(llm: LLM, prompts: list[list[int]]) -> None:
    """A prefill of fresh prompts, then decode steps over the same prompts, whose blocks
    the prefix cache then holds (each recomputes only its last prompt token)."""
    profile_run(llm, prompts, 1, "prefill")
    profile_run(llm, prompts, 32, "decode")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--profile", action="store_true", help="GPU time per kernel")
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)

    def random_prompts(n: int) -> list[list[int]]:
        vocab = LLAMA3_8B["vocab_size"]
        return [rng.integers(100, vocab - 100, args.prompt_len).tolist() for _ in range(n)]

    prompts = random_prompts(args.num_prompts)
    generated = args.num_prompts * args.output_len
    theirs = None if args.no_hf else run_hf(prompts, args.output_len, args.hf_batch)
    matmul_rate, copy_rate = matmul_flop_s(cuda_time), copy_bandwidth()
    work = Workload(args.num_prompts, args.prompt_len, args.output_len)
    floor = roofline(LLAMA3_8B, work, matmul_rate, copy_rate)
    torch.cuda.empty_cache()

    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(
        json.dumps({**LLAMA3_8B, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    start = time.perf_counter()
    max_len = args.prompt_len + args.output_len
    llm = LLM(str(folder), load_format="dummy", device="cuda", max_model_len=max_len)
    load_seconds = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # Warm up on other prompts: the measured ones must not be in the prefix cache.
    llm.generate(random_prompts(2), SamplingParams(max_tokens=4), use_tqdm=False)
    torch.cuda.synchronize()
    torch.cuda.reset_accumulated_memory_stats()  # the allocator's counts of the runs below
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    ours = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == generated
    # The prefill's share: as many fresh prompts, one output token each.
    start = time.perf_counter()
    llm.generate(random_prompts(args.num_prompts), SamplingParams(max_tokens=1), use_tqdm=False)
    torch.cuda.synchronize()
    prefill = time.perf_counter() - start

    total = generated + args.num_prompts * args.prompt_len
    rows = [("pyengine", f"{ours:.1f}", f"{generated / ours:.0f}", f"{total / ours:.0f}")]
    figures: dict[str, float] = {
        "pyengine_generated_tok_s": round(generated / ours, 1),
        "pyengine_total_tok_s": round(total / ours, 1),
        "pyengine_load_s": round(load_seconds, 1),
        "pyengine_prefill_only_s": round(prefill, 2),
        "kv_cache_blocks": llm.llm_engine.executor.driver_worker.model_runner.num_blocks,
        "matmul_tflop_s": round(matmul_rate / 1e12, 1),
        "copy_gb_s": round(copy_rate / 1e9, 1),
        "floor_any_engine_s": round(floor.any_engine_s, 2),
        "floor_prefill_then_decode_s": round(floor.phases_s, 2),
        "share_of_floor_prefill_then_decode": round(floor.phases_s / ours, 3),
    }
    if theirs is not None:
        rows.append((f"transformers (batch {args.hf_batch})", f"{theirs:.1f}",
                     f"{generated / theirs:.0f}", f"{total / theirs:.0f}"))  # fmt: skip
        figures["hf_generated_tok_s"] = round(generated / theirs, 1)
        figures["speedup_vs_hf_generated_tok_s"] = round(theirs / ours, 2)
        figures["speedup_cap_vs_hf"] = round(theirs / floor.any_engine_s, 2)
        figures["speedup_cap_vs_hf_prefill_then_decode"] = round(theirs / floor.phases_s, 2)
    print(
        f"# Offline throughput on {torch.cuda.get_device_name()}: Llama-3-8B shape, random "
        f"weights, bfloat16, {args.num_prompts} prompts of {args.prompt_len} tokens, "
        f"{args.output_len} output tokens each; KV cache "
        f"{llm.llm_engine.executor.driver_worker.model_runner.num_blocks} blocks"
    )
    print(f"pyengine: the same number of fresh prompts with 1 output token each: {prefill:.2f} s")
    print(
        f"hardware floors (roofline.py, at {matmul_rate / 1e12:.0f} TFLOP/s and "
        f"{copy_rate / 1e9:.0f} GB/s): any engine {floor.any_engine_s:.2f} s; prefill then "
        f"decode {floor.phases_s:.2f} s ({floor.prefill_s:.2f} + {floor.decode_s:.2f}), "
        f"pyengine at {floor.phases_s / ours:.0%} of it"
    )
    if theirs is not None:
        print(
            f"at most {theirs / floor.any_engine_s:.2f}x transformers for any engine, "
            f"{theirs / floor.phases_s:.2f}x prefilling before decoding"
        )
    # Where the caching allocator ran out of cached blocks and had to free them all and
    # retry, or went to cudaMalloc again, steps waited on the device: a KV budget that
    # left activations too little room shows here.
    stats = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")
    allocator = {key: stats.get(key, 0) for key in keys}
    peak = stats.get("allocated_bytes.all.peak", 0) / 2**30
    listed = ", ".join(f"{key} {value}" for key, value in allocator.items())
    print(f"allocator: {listed}; peak allocated {peak:.1f} GiB")
    figures.update({f"allocator_{key}": value for key, value in allocator.items()})
    if args.profile:
        profile_phases(llm, random_prompts(64))
    table = print_table(("engine", "seconds", "generated tok/s", "total tok/s"), rows)
    report("gpu_throughput", figures, tables=[table], device=torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
