"""Multi-LoRA throughput: the workload of bench/throughput.py (random prompts, greedy,
fixed output length) through 8 distinct rank-16 adapters over every projection, spread
round-robin over the requests, against the base model alone and against one adapter
merged into the weights (W + scale * B @ A: no adapter work at all), in one run, on the
default model's float32 weights. The adapters are PEFT folders written here in PEFT's
layout with random A and B. Target: the mixed run at least 85% of the base model's
generated tokens/s.

The last line printed is one JSON object, also written to bench/results/lora.json.

    python -m bench.lora [--num-prompts 32] [--min-len 64] [--max-len 512]
                         [--output-len 128] [--adapters 8] [--rank 16] [--rounds 2]
                         [--cache /tmp/pyengine-bench-gguf]

(from the repository root; bench/__init__.py says how with a plain install)
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from pyengine import LLM, LoRARequest, SamplingParams
from pyengine.lora.adapter import TARGET_MODULES

from .checkpoints import default_model_folders
from .common import add_workload_arguments, print_table, report

_PARENT = {m: "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
           for m in TARGET_MODULES}  # fmt: skip


def write_adapter(base: dict[str, torch.Tensor], folder: Path, rank: int, seed: int) -> None:
    """A PEFT folder: rank-`rank` A and B for every projection of every layer of `base`
    (its checkpoint tensors), random, scaled so that the deltas are a few percent of the
    base products."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, w in base.items():
        parts = name.split(".")
        if len(parts) < 5 or parts[-2] not in _PARENT or parts[-1] != "weight":
            continue
        out, inp = w.shape
        prefix = f"base_model.model.{name[: -len('.weight')]}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=generator) / inp**0.5
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(TARGET_MODULES), "bias": "none"}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))


def write_merged(source: Path, adapter: Path, folder: Path) -> None:
    """`source`'s checkpoint with `adapter` merged into its weights."""
    shutil.copytree(source, folder, dirs_exist_ok=True)
    weights = load_file(str(source / "model.safetensors"))
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    for name in list(weights):
        key = f"base_model.model.{name[: -len('.weight')]}"
        if f"{key}.lora_A.weight" in lora:
            a, b = lora[f"{key}.lora_A.weight"], lora[f"{key}.lora_B.weight"]
            weights[name] = (weights[name].double() + scale * b.double() @ a.double()).float()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def main() -> None:
    parser = add_workload_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="best of this many, each run")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/pyengine-bench-gguf"))
    args = parser.parse_args()

    base_folder = default_model_folders(args.cache)["float32"]
    base_weights = load_file(str(base_folder / "model.safetensors"))
    lora_root = args.cache / f"lora-r{args.rank}"
    requests = []
    for i in range(args.adapters):
        folder = lora_root / f"adapter-{i}"
        write_adapter(base_weights, folder, args.rank, args.seed + i)
        requests.append(LoRARequest(f"adapter-{i}", i + 1, str(folder)))
    merged_folder = lora_root / "merged-0"
    write_merged(base_folder, Path(requests[0].lora_path), merged_folder)

    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_len, args.max_len + 1, args.num_prompts)
    prompts = [rng.integers(100, 49_000, n).tolist() for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    generated = args.num_prompts * args.output_len
    engine = dict(max_model_len=args.max_len + args.output_len + 16, seed=args.seed)
    loras = [requests[i % len(requests)] for i in range(len(prompts))]
    runs = {
        "base": (base_folder, {}, None),
        "mixed": (base_folder, {"enable_lora": True, "max_loras": args.adapters,
                                "max_lora_rank": args.rank}, loras),
        "merged": (merged_folder, {}, None),
    }  # fmt: skip
    llms = {name: LLM(str(folder), **engine, **extra) for name, (folder, extra, _) in runs.items()}
    for name, llm in llms.items():  # warm up (the adapters read)
        warm = runs[name][2]
        llm.generate(prompts[: len(requests)], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=warm[: len(requests)] if warm else None)  # fmt: skip

    best = dict.fromkeys(runs, float("inf"))
    for _ in range(args.rounds):  # the runs alternate: the machine is shared
        for name, llm in llms.items():
            llm.llm_engine.scheduler.kv_cache.reset_prefix_cache()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=runs[name][2])
            best[name] = min(best[name], time.perf_counter() - start)
            assert sum(len(o.outputs[0].token_ids) for o in outputs) == generated
    for llm in llms.values():
        llm.llm_engine.shutdown()

    rate = {name: generated / seconds for name, seconds in best.items()}
    labels = {
        "base": "base model alone",
        "mixed": f"{args.adapters} adapters (rank {args.rank}, every projection), mixed",
        "merged": "one adapter merged into the weights",
    }
    rows = [(labels[n], f"{best[n]:.1f}", f"{rate[n]:.1f}", f"{rate[n] / rate['base']:.0%}")
            for n in runs]  # fmt: skip
    print(
        f"# Multi-LoRA offline throughput: SmolLM2-135M-Instruct float32, {args.num_prompts} "
        f"prompts of {args.min_len}-{args.max_len} tokens, {args.output_len} output tokens "
        f"each, {torch.get_num_threads()} threads, best of {args.rounds}\n"
    )
    table = print_table(("run", "seconds", "generated tok/s", "of the base model's"), rows)
    figures = {
        "base_generated_tok_s": round(rate["base"], 1),
        "mixed_generated_tok_s": round(rate["mixed"], 1),
        "merged_generated_tok_s": round(rate["merged"], 1),
        "mixed_share_of_base": round(rate["mixed"] / rate["base"], 3),
        "mixed_share_of_merged": round(rate["mixed"] / rate["merged"], 3),
        "adapters": args.adapters,
        "rank": args.rank,
    }
    report("lora", figures, tables=[table])


if __name__ == "__main__":
    main()
