"""Attention variants: the KV memory a request holds under the hybrid KV cache.

Memory: a request's KV bytes held at 1k, 8k and 32k tokens, for a Gemma-3-1B-shaped
model (26 layers, one 256-wide kv head, a 512-token window on 5 layers of 6) and a
gpt-oss-20b-shaped one (24 layers, eight 64-wide kv heads, a 128-token window on every
other layer), in bfloat16, against the same layers all under full attention. The
figures are what pyengine's own KV-cache manager holds: the model's KVLayout (its
groups and the pages of a block) and a KVCacheManager of those groups, which schedules
the request as the engine does (prefill in chunks of max_num_batched_tokens, then
decode steps), counting the blocks of every group the request holds after its last
step. A window's memory is flat past the window; full attention's grows with the
context.

MLA decode: DeepSeek's latent attention kernel (ops.mla_attention, the absorbed form)
on DeepSeek-V2-Lite's shape (16 heads, a latent of 512 + 64, bfloat16) for one decoding
token a request, against its bandwidth bound: the latent bytes a step reads over the read
bandwidth measured in the same run. From memory (each call after the CPU's caches are
flushed: the target's figures) and warm (the call repeated over the same latents, which a
large L3 may hold: then past the memory's bound).

Engines (--engines): dummy-weight models of Gemma-3-1B's and DeepSeek-V2-Lite's shapes
(bench/variant_checkpoints.py: SmolLM2's vocabulary; DeepSeek-V2-Lite's first
--deepseek-layers layers), each engine in a process of its own: offline, --num-prompts
prompts of --min-len to --max-len random tokens and --output-len greedy tokens each,
through pyengine and vLLM's CPU build (--vllm-python) at their defaults (bfloat16), and
transformers' generate in bfloat16 on random weights (--transformers); one stream of
--stream-len tokens after a --stream-prompt-len-token prompt through each server.

    python -m bench.attention_variants [--contexts 1024,8192,32768] [--block-size 16]
                                       [--mla-contexts 4096,16384] [--engines]
                                       [--vllm-python PY] [--transformers]
                                       [--deepseek-layers 4] [--num-prompts 32]
                                       [--min-len 64] [--max-len 512] [--output-len 128]
                                       [--stream-prompt-len 16384] [--stream-len 64]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pyengine import KVCacheManager, ops
from pyengine.worker.kv_layout import KVLayout, KVSpec, plan_kv_layout
from pyengine.worker.model_runner import allocate_kv_pool

from .attention_cpu import read_bandwidth
from .checkpoints import default_model_folders
from .common import add_workload_arguments, best_time, cold_best_time, print_table, report
from .cpu_peers import Model, offline, one_stream, pyengine_server, vllm_server
from .throughput import run_hf
from .variant_checkpoints import GEMMA3_1B, deepseek_v2_lite, variant_folder


@dataclass(frozen=True)
class Shape:
    name: str
    specs: list[KVSpec]  # each layer's
    kv_heads: int
    head_size: int

    def page_bytes(self, block_size: int, itemsize: int = 2) -> int:
        """One layer's K and V of one block."""
        return 2 * self.kv_heads * self.head_size * block_size * itemsize


SHAPES = (
    Shape(
        "Gemma-3-1B",
        [("full", 0) if i % 6 == 5 else ("sliding", 512) for i in range(26)],
        kv_heads=1,
        head_size=256,
    ),
    Shape(
        "gpt-oss-20b",
        [("sliding", 128) if i % 2 == 0 else ("full", 0) for i in range(24)],
        kv_heads=8,
        head_size=64,
    ),
)


def held_blocks(
    layout: KVLayout, context: int, block_size: int, chunk: int, decode: int
) -> tuple[int, int]:
    """Blocks of the full groups and of the window groups one request holds once it has
    prefilled `context - decode` tokens in chunks and decoded `decode` more, one a step."""
    blocks = layout.max_blocks_held(context, chunk, block_size) + 1
    kv = KVCacheManager(
        blocks, block_size, enable_prefix_caching=False, kv_groups=list(layout.groups)
    )
    prompt = context - decode
    kv.add_request("r", [1] * prompt)
    done = 0
    while done < prompt:
        n = min(chunk, prompt - done)
        if kv.allocate_slots("r", n) is None:
            raise RuntimeError("the bound on a request's blocks is too low")
        done += n
    for _ in range(decode):
        kv.append_token_ids("r", [1])
        if kv.allocate_slots("r", 1) is None:
            raise RuntimeError("the bound on a request's blocks is too low")
    held = [sum(b >= 0 for b in kv.block_table("r", g)) for g in range(kv.num_groups)]
    kv.free("r")
    windows = sum(n for n, (kind, _) in zip(held, layout.groups, strict=True) if kind != "full")
    return sum(held) - windows, windows


def memory_table(args: argparse.Namespace, figures: dict[str, Any]) -> str:
    rows = []
    for shape in SHAPES:
        layout = plan_kv_layout(shape.specs)
        full = plan_kv_layout([("full", 0)] * len(shape.specs))
        page = shape.page_bytes(args.block_size)
        for context in args.contexts:
            full_part, window_part = held_blocks(
                layout, context, args.block_size, args.chunk, args.decode
            )
            every = sum(held_blocks(full, context, args.block_size, args.chunk, args.decode))
            block = layout.num_slots * page
            ours, windows = (full_part + window_part) * block, window_part * block
            theirs = every * full.num_slots * page
            key = f"{shape.name.lower().replace('-', '_')}_{context}"
            figures[f"kv_mib_{key}"] = round(ours / 2**20, 2)
            figures[f"kv_mib_windows_{key}"] = round(windows / 2**20, 2)
            figures[f"kv_mib_full_attention_{key}"] = round(theirs / 2**20, 2)
            figures[f"kv_saving_{key}"] = round(theirs / ours, 2)
            rows.append((
                shape.name, f"{len(layout.groups)} x {layout.num_slots}", f"{context:,}",
                f"{windows / 2**20:,.1f}", f"{ours / 2**20:,.1f}", f"{theirs / 2**20:,.1f}",
                f"{theirs / ours:.2f}x",
            ))  # fmt: skip
    print(f"\nKV bytes one request holds (bfloat16, blocks of {args.block_size} tokens, prefill "
          f"in chunks of {args.chunk}, then {args.decode} decode steps)")  # fmt: skip
    return print_table(
        (
            "model shape",
            "groups x pages",
            "context",
            "window groups MiB",
            "hybrid MiB",
            "all full MiB",
            "saving",
        ),
        rows,
    )


MLA_HEADS, MLA_RANK, MLA_ROPE = 16, 512, 64


def mla_decode_seconds(batch: int, context: int, bs: int, cold: bool) -> float:
    """The best time of one decoding token a request over `context` latents each, in
    the engine's KV pool memory (huge pages where the OS gives them), blocks shuffled;
    `cold`: each call with the latents out of the CPU's caches (as a server's many
    requests and layers leave them), else called again and again over the same ones."""
    d, per = MLA_RANK + MLA_ROPE, -(-context // bs)
    cache = allocate_kv_pool(batch * per * bs * d, torch.bfloat16, torch.device("cpu"))
    cache = cache.view(batch * per, bs, d)
    cache.copy_(torch.randn(batch * per, bs, d))
    tables = torch.randperm(batch * per, dtype=torch.int32).view(batch, per)
    lens = torch.full((batch,), context, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    query = torch.randn(batch, MLA_HEADS, d).to(torch.bfloat16)
    out = torch.empty(batch, MLA_HEADS, MLA_RANK, dtype=torch.bfloat16)

    def step() -> None:
        ops.mla_attention(out, query, cache, tables, lens, qsl, 0.07, MLA_RANK)

    return cold_best_time(step) if cold else best_time(step)


def mla_decode_table(args: argparse.Namespace, figures: dict[str, Any]) -> str:
    """From memory (the target's figures) and warm (what the CPU's caches hold of the
    latents helps: on a CPU with a large L3 that can pass the memory's bound)."""
    bandwidth = read_bandwidth()
    figures["read_bandwidth_gb_s"] = round(bandwidth / 1e9, 2)
    rows = []
    d = MLA_RANK + MLA_ROPE
    for batch in (1, 8):
        for context in args.mla_contexts:
            read = batch * context * d * 2
            key = f"b{batch}_ctx{context}"
            row = [f"{batch}", f"{context:,}", f"{read / 2**20:.1f}"]
            for cold, name in ((True, "bandwidth"), (False, "warm")):
                seconds = mla_decode_seconds(batch, context, args.block_size, cold)
                share = read / seconds / bandwidth
                figures[f"mla_decode_{'' if cold else 'warm_'}ms_{key}"] = round(seconds * 1e3, 3)
                figures[f"mla_decode_{name}_share_{key}"] = round(share, 3)
                row += [f"{seconds * 1e3:.3f}", f"{read / seconds / 1e9:.1f}", f"{share:.0%}"]
            rows.append(tuple(row))
    figures["target_mla_decode_70pct_bandwidth"] = bool(
        np.mean([v for k, v in figures.items() if k.startswith("mla_decode_bandwidth_share")])
        >= 0.7
    )
    print(f"\nMLA decode attention (DeepSeek-V2-Lite: {MLA_HEADS} heads, latent {MLA_RANK} + "
          f"{MLA_ROPE}, bfloat16; read bandwidth {bandwidth / 1e9:.1f} GB/s, "
          f"{torch.get_num_threads()} threads; from memory: the latents out of the caches "
          f"each call; warm: the same call again and again)")  # fmt: skip
    return print_table(
        ("requests", "context", "latent MiB read", "ms from memory", "GB/s", "of the bound",
         "ms warm", "GB/s warm", "warm / bound"), rows,
    )  # fmt: skip


def transformers_offline(folder: Path, prompts: list[list[int]], args: argparse.Namespace) -> float:
    """transformers' generate in bfloat16 on random weights (batches of 32): tokens/s."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    seconds = min(run_hf(hf.eval(), prompts, args.output_len, 32) for _ in range(args.rounds))
    return float(len(prompts) * args.output_len / seconds)


def engine_tables(args: argparse.Namespace, figures: dict[str, Any]) -> list[str]:
    tokenizer = default_model_folders(args.cache)["float32"]
    shapes = {
        "Gemma-3-1B": variant_folder("gemma-3-1b", GEMMA3_1B, tokenizer, args.cache),
        f"DeepSeek-V2-Lite ({args.deepseek_layers} layers)": variant_folder(
            f"deepseek-v2-lite-{args.deepseek_layers}", deepseek_v2_lite(args.deepseek_layers),
            tokenizer, args.cache,
        ),
    }  # fmt: skip
    return compare_engines(shapes, args, figures)


def compare_engines(
    shapes: dict[str, Path], args: argparse.Namespace, figures: dict[str, Any]
) -> list[str]:
    """Each shape's folder (dummy weights) through pyengine, vLLM's CPU build
    (--vllm-python) and transformers (--transformers): offline, and one stream through
    each server; their tables, and each engine's figures under engines_<shape>."""
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_len, args.max_len + 1, args.num_prompts)
    prompts = [rng.integers(100, 49152 - 100, n).tolist() for n in lengths]
    stream_prompt = rng.integers(100, 49152 - 100, args.stream_prompt_len).tolist()
    offline_rows, stream_rows = [], []
    for name, folder in shapes.items():
        key = name.split()[0].lower().replace("-", "_").replace(".", "")
        model = Model(name, folder, "dummy", None, 0)
        runs = {"pyengine": offline(sys.executable, "pyengine", model, "auto", prompts, args)}
        print(f"{name} pyengine offline: {runs['pyengine']}", flush=True)
        if args.vllm_python:
            try:
                runs["vLLM"] = offline(args.vllm_python, "vllm", model, "auto", prompts, args)
                print(f"{name} vLLM offline: {runs['vLLM']}", flush=True)
            except RuntimeError as error:  # (its CPU build may not run the architecture)
                print(f"{name} vLLM offline failed: {str(error)[-600:]}", flush=True)
                figures[f"vllm_failed_{key}"] = str(error)[-300:]
        if args.transformers:
            tok_s = transformers_offline(folder, prompts, args)
            runs["transformers"] = {"generated_tok_s": tok_s}
            print(f"{name} transformers offline: {tok_s:.1f} tok/s", flush=True)
        ours = runs["pyengine"]["generated_tok_s"]
        for engine, r in runs.items():
            ratio = ours / r["generated_tok_s"]
            if engine != "pyengine":
                figures[f"speedup_vs_{engine.lower()}_offline_{key}"] = round(ratio, 2)
            offline_rows.append((name, engine, f"{r['generated_tok_s']:.1f}", f"{ratio:.2f}"))
        streams = {}
        command, port = pyengine_server(model, "auto", args)
        streams["pyengine"] = one_stream(command, {}, port, stream_prompt, args, "pyengine")
        print(f"{name} pyengine stream: {streams['pyengine']}", flush=True)
        if args.vllm_python and "vLLM" in runs:
            env = {"VLLM_CPU_KVCACHE_SPACE": str(int(args.kv_cache_gib))}
            command, port = vllm_server(model, args)
            streams["vLLM"] = one_stream(command, env, port, stream_prompt, args, "vLLM")
            print(f"{name} vLLM stream: {streams['vLLM']}", flush=True)
        for engine, r in streams.items():
            ratio = streams["pyengine"]["decode_tok_s"] / r["decode_tok_s"]
            if engine != "pyengine":
                figures[f"speedup_vs_{engine.lower()}_stream_{key}"] = round(ratio, 2)
            stream_rows.append((name, engine, f"{r['decode_tok_s']:.1f}", f"{ratio:.2f}",
                                f"{r['ttft_s']:.1f}", f"{r['resident_mib']:.0f}"))  # fmt: skip
        figures[f"engines_{key}"] = {"offline": runs, "stream": streams}
    print(f"\nOffline: {args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens, "
          f"{args.output_len} greedy tokens each (dummy weights, bfloat16)")  # fmt: skip
    t1 = print_table(("model shape", "engine", "generated tok/s", "pyengine / it"),
                     offline_rows, 2)  # fmt: skip
    print(f"\nOne stream: {args.stream_len} tokens after a {args.stream_prompt_len}-token "
          "prompt")  # fmt: skip
    t2 = print_table(("model shape", "server", "decode tok/s", "pyengine / it", "TTFT (s)",
                      "resident MiB"), stream_rows, 2)  # fmt: skip
    return [t1, t2]


def main() -> None:
    parser = add_workload_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--decode", type=int, default=16, help="decode steps at the end")
    parser.add_argument("--mla-contexts", default="4096,16384")
    parser.add_argument("--engines", action="store_true", help="the models end to end")
    parser.add_argument("--vllm-python", help="the Python of vLLM's CPU build")
    parser.add_argument("--transformers", action="store_true")
    parser.add_argument("--deepseek-layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--stream-prompt-len", type=int, default=16384)
    parser.add_argument("--stream-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=17408)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache/pyengine-bench")
    args = parser.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.mla_contexts = [int(c) for c in args.mla_contexts.split(",")]
    figures: dict[str, Any] = {}
    tables = [memory_table(args, figures), mla_decode_table(args, figures)]
    if args.engines:
        tables += engine_tables(args, figures)
    report("attention_variants", figures, tables=tables)


if __name__ == "__main__":
    main()
