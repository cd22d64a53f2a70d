"""Mixture-of-experts layers: the experts' fused kernel alone at Qwen3-30B-A3B's shapes
(hidden 2048, 128 experts, top 8, expert size 768), against a torch reference that loops
over the active experts, and a decode step's against the bound of reading its active
experts' bytes once at the machine's read bandwidth (measured here: torch's sum over a
2 GiB buffer, best of the run).

For 1, 8, 64 and 512 tokens (random hidden states, routed by random router logits
through the softmax top-8; each call times one of 8 routings after a read of a buffer
larger than the last-level cache, so that its experts' weights come from memory as a
model's layer finds them), in two forms: bfloat16 panels (a bfloat16 model's), and
8-bit blocks (GGUF's Q8_0) with int8 activations (llama.cpp's arithmetic). The torch
reference multiplies the same weights in bfloat16 with torch's matmul, an active expert
at a time, as transformers' MoE blocks do. Each time is the best of the 8 calls, the
peer's in the same process.

End to end (unless --no-engines), a model of those layer shapes with a few layers
(--layers; SmolLM2's vocabulary and tokenizer: bench/moe_checkpoint.py):
- offline: --num-prompts prompts of --min-len to --max-len random tokens, --output-len
  greedy tokens each, all at once, through pyengine's LLM at its defaults and vLLM's
  CPU build at its own (bfloat16; --vllm-python, in its own virtual environment), each
  in a process of its own on dummy weights (bench/engine_peer.py), and transformers'
  generate in bfloat16 on random weights (--transformers; batches of 32);
- one stream: --stream-len tokens after a prompt of --stream-prompt-len through
  pyengine's server (dummy weights, its default bfloat16) and llama.cpp's llama-server
  (--llama-bin) on a bfloat16 GGUF of that shape (random weights of its own); then both
  on the Q8_0 file llama-quantize makes of that GGUF (the same weights; pyengine at its
  default, the experts in their blocks, int8 activations on VNNI); each against the
  bound of the bytes a token reads (attention, router, the top 8 experts and the head)
  at the read bandwidth. (On this AMX machine llama.cpp's repacked layouts crash its
  server on the Q8_0 file (SIGSEGV): the recorded run passes --llama-options=--no-repack,
  as bench/cpu_peers.py's does.)

The last line printed is one JSON object, also written to bench/results/moe.json.

    python -m bench.moe [--tokens 1,8,64,512] [--experts 128] [--no-engines]
                        [--layers 4] [--vllm-python PY] [--transformers]
                        [--llama-bin DIR] [--llama-options ...] [--rounds 1]
                        [--num-prompts 32] [--min-len 64] [--max-len 512]
                        [--output-len 128] [--stream-len 256] [--cache DIR]

(from the repository root; bench/__init__.py says how with a plain install)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pyengine import ops
from pyengine.layers.block_quantized import BLOCK, BlockQuantized
from pyengine.layers.moe.routing import Routing, RoutingConfig, route
from pyengine.layers.quantization.packing import pack_bf16, pack_block_quantized

from .checkpoints import default_model_folders
from .common import add_workload_arguments, print_table, report
from .cpu_peers import Model, offline, one_stream, pyengine_server
from .moe_checkpoint import bf16_gguf, decode_bytes, moe_folder, quantized_gguf
from .quantized import free_port
from .throughput import run_hf

HIDDEN, EXPERT_SIZE, TOP_K = 2048, 768, 8


def random_q8_0(rows: int, columns: int) -> BlockQuantized:
    q = torch.randint(-128, 128, (rows, columns), dtype=torch.int8)
    scale = (torch.rand(rows, columns // BLOCK) * 0.001).half().float()
    return BlockQuantized(q.numpy(), scale.numpy(), torch.full_like(scale, -0.0).numpy())


class LayerForms:
    """One layer's experts: bfloat16 weights (torch's), and their packed stacks in each
    form the kernel takes."""

    def __init__(self, experts: int) -> None:
        self.gate_up = torch.randn(experts, 2 * EXPERT_SIZE, HIDDEN, dtype=torch.bfloat16) * 0.02
        self.down = torch.randn(experts, HIDDEN, EXPERT_SIZE, dtype=torch.bfloat16) * 0.02
        self.stacks = {
            "bfloat16": (
                torch.stack([pack_bf16(w.t().float().contiguous(), True) for w in self.gate_up]),
                torch.stack([pack_bf16(w.t().float().contiguous(), False) for w in self.down]),
            ),
            "int8": (
                torch.stack([pack_block_quantized(random_q8_0(2 * EXPERT_SIZE, HIDDEN), True)
                             for _ in range(experts)]),
                torch.stack([pack_block_quantized(random_q8_0(HIDDEN, EXPERT_SIZE))
                             for _ in range(experts)]),
            ),
        }  # fmt: skip

    def expert_bytes(self, form: str) -> int:
        """Bytes of one expert's packed weights."""
        gate_up, down = self.stacks[form]
        return gate_up[0].nbytes + down[0].nbytes


class ColdCache:
    """A buffer larger than the CPU's last-level cache (some hold hundreds of MiB), read
    before each timed call so that the call finds its weights in memory, as a model's
    layer does after the layers before it; each read is also a sample of the machine's
    read bandwidth."""

    def __init__(self, nbytes: int = 2**31) -> None:
        self.data = torch.ones(nbytes // 4)
        self.best_read = float("inf")

    def flush(self) -> None:
        start = time.perf_counter()
        self.data.sum()
        self.best_read = min(self.best_read, time.perf_counter() - start)

    @property
    def bandwidth(self) -> float:
        return self.data.nbytes / self.best_read

    def best_time(self, calls: list[Callable[[], None]]) -> float:
        """The fastest of `calls` (after a warm-up call of each), each timed after a
        flush."""
        for call in calls:
            call()
        best = float("inf")
        for call in calls:
            self.flush()
            start = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - start)
        return best


def fused(forms: LayerForms, form: str, x: torch.Tensor, routing: Routing) -> Callable[[], None]:
    gate_up, down = forms.stacks[form]
    ids, weights = routing.expert_ids.to(torch.int32), routing.weights.float()
    out = torch.empty_like(x)
    int8 = form == "int8"
    return lambda: ops.fused_experts(out, x, ids, weights, gate_up, down, EXPERT_SIZE, False, int8)


def torch_loop(forms: LayerForms, x: torch.Tensor, routing: Routing) -> Callable[[], None]:
    """transformers' loop over the active experts, in bfloat16."""
    xb = x.bfloat16()
    weights = routing.weights.bfloat16()

    def run() -> None:
        out = torch.zeros_like(xb)
        for expert in torch.unique(routing.expert_ids).tolist():
            rows, slots = torch.where(routing.expert_ids == expert)
            gate, up = F.linear(xb[rows], forms.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, forms.down[expert])
            out.index_add_(0, rows, y * weights[rows, slots, None])

    return run


ROUTINGS_CYCLED = 8


def layer_table(args: argparse.Namespace, figures: dict[str, Any]) -> str:
    """The experts alone: each form against the torch loop and the bandwidth bound."""
    torch.manual_seed(0)
    forms = LayerForms(args.experts)
    config = RoutingConfig("softmax", TOP_K, args.experts, renormalize=True)
    cache = ColdCache()
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(tokens, HIDDEN)
        routings = [
            route(torch.randn(tokens, args.experts), config) for _ in range(ROUTINGS_CYCLED)
        ]
        active = sum(len(torch.unique(r.expert_ids)) for r in routings) / len(routings)
        peer = cache.best_time([torch_loop(forms, x, r) for r in routings])
        for form in ("bfloat16", "int8"):
            xf = x.bfloat16() if form == "bfloat16" else x
            ours = cache.best_time([fused(forms, form, xf, r) for r in routings])
            bound = active * forms.expert_bytes(form) / cache.bandwidth
            key = f"{form}_{tokens}"
            figures[f"{key}_us"] = round(ours * 1e6, 1)
            figures[f"{key}_torch_us"] = round(peer * 1e6, 1)
            figures[f"speedup_vs_torch_{key}"] = round(peer / ours, 2)
            figures[f"{key}_of_bandwidth_bound"] = round(bound / ours, 3)
            rows.append((
                form, str(tokens), f"{active:.1f}", f"{ours * 1e3:.2f}", f"{peer * 1e3:.2f}",
                f"{peer / ours:.2f}x", f"{bound * 1e3:.2f}", f"{bound / ours:.0%}",
            ))  # fmt: skip
    figures["read_bandwidth_gb_s"] = round(cache.bandwidth / 1e9, 1)
    del forms
    print(
        f"The experts of one layer at Qwen3-30B-A3B's shapes ({args.experts} experts, top "
        f"{TOP_K}, hidden {HIDDEN}, expert size {EXPERT_SIZE}); read bandwidth "
        f"{cache.bandwidth / 1e9:.1f} GB/s\n"
    )
    return print_table(
        ("form", "tokens", "active experts", "fused ms", "torch loop ms (bf16)", "speedup",
         "bandwidth bound ms", "of the bound"),
        rows, num_text_columns=1,
    )  # fmt: skip


def transformers_offline(folder: Path, prompts: list[list[int]], args: argparse.Namespace) -> float:
    """transformers' generate in bfloat16 on random weights: generated tokens/s."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    seconds = min(run_hf(hf.eval(), prompts, args.output_len, 32) for _ in range(args.rounds))
    return float(len(prompts) * args.output_len / seconds)


def llama_server(gguf: Path, args: argparse.Namespace) -> tuple[list[str], int]:
    port = free_port()
    command = [str(args.llama_bin / "llama-server"), "-m", str(gguf), "--port", str(port),
               "-c", str(args.max_model_len), "-np", "1", "--no-webui",
               *args.llama_options.split()]  # fmt: skip
    return command, port


def stream_pairs(
    model: Model, prompt: list[int], args: argparse.Namespace, figures: dict[str, Any]
) -> tuple[dict[tuple[str, str], dict[str, Any]], dict[str, float]]:
    """One stream through each server, by (weights, server): bfloat16 (pyengine's dummy
    weights at its default; llama.cpp on the bfloat16 GGUF) and, with llama.cpp's tools,
    Q8_0 (both on the file llama-quantize makes of that GGUF: the same weights); and each
    form's bound in tokens/s."""
    streams = {}
    command, port = pyengine_server(model, "auto", args)
    streams["bf16", "pyengine"] = one_stream(command, {}, port, prompt, args, "pyengine")
    print(f"pyengine bf16 stream: {streams['bf16', 'pyengine']}", flush=True)
    bandwidth = figures["read_bandwidth_gb_s"] * 1e9
    bounds = {"bf16": bandwidth / model.decode_bytes}
    if args.llama_bin:
        bf16 = bf16_gguf(args.layers, args.cache)
        command, port = llama_server(bf16, args)
        streams["bf16", "llama.cpp"] = one_stream(command, {}, port, prompt, args, "llama.cpp")
        print(f"llama.cpp bf16 stream: {streams['bf16', 'llama.cpp']}", flush=True)
        q8_0 = quantized_gguf(bf16, "Q8_0", args.llama_bin)
        served = Model(model.name, model.folder, "auto", q8_0, model.decode_bytes)
        command, port = pyengine_server(served, "auto", args)
        streams["q8_0", "pyengine"] = one_stream(command, {}, port, prompt, args, "pyengine")
        print(f"pyengine q8_0 stream: {streams['q8_0', 'pyengine']}", flush=True)
        command, port = llama_server(q8_0, args)
        streams["q8_0", "llama.cpp"] = one_stream(command, {}, port, prompt, args, "llama.cpp")
        print(f"llama.cpp q8_0 stream: {streams['q8_0', 'llama.cpp']}", flush=True)
        bounds["q8_0"] = bandwidth / (model.decode_bytes * 34 / 64)
    return streams, bounds


def engine_tables(args: argparse.Namespace, figures: dict[str, Any]) -> list[str]:
    """The model end to end: offline against vLLM and transformers, one stream against
    llama.cpp and the bound."""
    folder = moe_folder(args.layers, default_model_folders(args.cache)["float32"], args.cache)
    model = Model(f"{args.layers} layers", folder, "dummy", None, decode_bytes(args.layers))
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_len, args.max_len + 1, args.num_prompts)
    prompts = [rng.integers(100, 49152 - 100, n).tolist() for n in lengths]
    stream_prompt = rng.integers(100, 49152 - 100, args.stream_prompt_len).tolist()
    runs: dict[str, dict[str, Any]] = {
        "pyengine auto": offline(sys.executable, "pyengine", model, "auto", prompts, args)
    }
    print(f"pyengine offline: {runs['pyengine auto']}", flush=True)
    if args.vllm_python:
        runs["vllm auto"] = offline(args.vllm_python, "vllm", model, "auto", prompts, args)
        print(f"vllm offline: {runs['vllm auto']}", flush=True)
    if args.transformers:
        tok_s = transformers_offline(folder, prompts, args)
        runs["transformers bfloat16"] = {"generated_tok_s": tok_s, "startup_s": None,
                                         "resident_mib": None}  # fmt: skip
        print(f"transformers offline: {tok_s:.1f} tok/s", flush=True)
    streams, bounds = stream_pairs(model, stream_prompt, args, figures)
    ours = runs["pyengine auto"]
    offline_rows = []
    for name, r in runs.items():
        ratio = ours["generated_tok_s"] / r["generated_tok_s"]
        startup, resident = r["startup_s"], r["resident_mib"]
        offline_rows.append((name, f"{r['generated_tok_s']:.1f}", f"{ratio:.2f}",
                             "-" if startup is None else f"{startup:.0f}",
                             "-" if resident is None else f"{resident:.0f}"))  # fmt: skip
        peer = name.split()[0].replace(".", "")
        if name != "pyengine auto":
            figures[f"speedup_vs_{peer}_offline"] = round(ratio, 2)
    stream_rows = []
    for (form, server), r in streams.items():
        ratio = streams[form, "pyengine"]["decode_tok_s"] / r["decode_tok_s"]
        stream_rows.append((form, server, f"{r['decode_tok_s']:.1f}", f"{ratio:.2f}",
                            f"{r['decode_tok_s'] / bounds[form]:.0%}",
                            f"{r['ttft_s'] * 1e3:.0f}", f"{r['resident_mib']:.0f}"))  # fmt: skip
        if server == "pyengine":
            figures[f"stream_share_of_bound_{form}"] = round(r["decode_tok_s"] / bounds[form], 3)
        else:
            figures[f"speedup_vs_llamacpp_stream_{form}"] = round(ratio, 2)
    figures["engines"] = {"offline": runs, "decode_bytes": model.decode_bytes,
                          "stream": {f"{f} {e}": r for (f, e), r in streams.items()}}  # fmt: skip
    print(f"\nOffline, a {args.layers}-layer model of those shapes: {args.num_prompts} "
          f"prompts of {args.min_len}-{args.max_len} tokens, {args.output_len} greedy tokens "
          "each")  # fmt: skip
    t1 = print_table(("engine, dtype", "generated tok/s", "pyengine / it",
                      "start-up to 1st token (s)", "resident MiB"), offline_rows)  # fmt: skip
    bandwidth = figures["read_bandwidth_gb_s"]
    print(f"\nOne stream: {args.stream_len} tokens after {args.stream_prompt_len}; the bound "
          f"is the bytes a token reads ({model.decode_bytes / 1e6:.0f} MB in bfloat16, 34/64 "
          f"of that in Q8_0) at {bandwidth:.1f} GB/s")  # fmt: skip
    t2 = print_table(("weights", "server", "decode tok/s", "pyengine / it", "of the bound",
                      "TTFT (ms)", "resident MiB"), stream_rows, 2)  # fmt: skip
    return [t1, t2]


def main() -> None:
    parser = add_workload_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--tokens", default="1,8,64,512")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--no-engines", action="store_true", help="the layer alone")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vllm-python", help="the Python of vLLM's CPU build")
    parser.add_argument("--transformers", action="store_true")
    parser.add_argument("--llama-bin", type=Path, help="llama-server's folder")
    parser.add_argument("--llama-options", default="")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--stream-len", type=int, default=256)
    parser.add_argument("--stream-prompt-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache/pyengine-bench")
    args = parser.parse_args()
    figures: dict[str, Any] = {}
    tables = [layer_table(args, figures)]
    if not args.no_engines:
        tables += engine_tables(args, figures)
    report("moe", figures, tables=tables)


if __name__ == "__main__":
    main()
