"""The C API against the Python API on the same engine and workload: offline throughput
(--num-prompts prompts of --min-len to --max-len random tokens, --max-tokens tokens each,
greedy, ignore_eos) through cpp/examples/batch_threads (1 submitting thread, and 8)
against LLM.generate, and single-stream decode (one prompt of --min-len tokens,
--decode-tokens tokens) through the C API's callback (batch_threads --stream) against
LLM.generate of that one prompt.

The example is built by CMake against the installed package, as an embedder builds it,
and runs in its own process, its engine made before the clock starts; LLM.generate runs
in this process. The two take turns, round by round (--rounds rounds of fresh prompts,
the same on both sides, so that prefix caching finds nothing; the first round of each
is a warm-up), so that the machine's drift falls on both alike; the figure is each
side's best round. speedup_vs_python_api... = the Python API's time / the C API's
(1.0: as fast; the target is at least 0.95).

    python -m bench.c_api [--model M] [--num-prompts 32] [--min-len 64] [--max-len 512]
                          [--max-tokens 128] [--decode-tokens 256] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from pyengine import LLM, SamplingParams
from pyengine.capi import files

from .common import print_table, report

EXAMPLES = Path(__file__).resolve().parents[1] / "cpp" / "examples"


def build_example(folder: Path) -> Path:
    """cpp/examples built against the installed package; batch_threads' path."""
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(EXAMPLES), "-B", str(folder), *generator,
                    f"-Dpyengine_DIR={files.cmake_dir()}", "-DCMAKE_BUILD_TYPE=Release"],
                   check=True, capture_output=True)  # fmt: skip
    subprocess.run(["cmake", "--build", str(folder), "--target", "batch_threads"], check=True,
                   capture_output=True)  # fmt: skip
    return folder / "batch_threads"


def prompts(rounds: int, count: int, low: int, high: int, vocab: int, seed: int) -> list:
    """`rounds` lists of `count` prompts of random token ids, [low, high] tokens each."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(100, vocab - 100, rng.integers(low, high + 1)).tolist()
             for _ in range(count)] for _ in range(rounds)]  # fmt: skip


def in_turns(
    binary: Path, model: str | None, llm: LLM, workload: list, max_tokens: int, threads: int,
    stream: bool, folder: Path,
) -> tuple[list[float], list[float]]:  # fmt: skip
    """Each round's seconds through the C API and through LLM.generate, in turns."""
    prompts_file = folder / "prompts.txt"
    prompts_file.write_text("".join(" ".join(map(str, p)) + "\n" for b in workload for p in b))
    args = [str(binary), "--token-prompts", "--ignore-eos", "--threads", str(threads),
            "--max-tokens", str(max_tokens), "--rounds", str(len(workload)), "--step",
            "--prompts", str(prompts_file)]  # fmt: skip
    args += ["--model", model] if model else []
    args += ["--stream"] if stream else []
    c_api = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert c_api.stdin is not None and c_api.stderr is not None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    c_seconds, python_seconds = [], []
    for batch in workload:
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        python_seconds.append(time.perf_counter() - start)
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == max_tokens * len(batch)
        c_api.stdin.write("\n")
        c_api.stdin.flush()
        line = c_api.stderr.readline()
        while line and not line.startswith("round "):  # (the engine's log lines)
            line = c_api.stderr.readline()
        if not line:
            raise RuntimeError(f"batch_threads ended early: {c_api.wait()}")
        c_seconds.append(float(line.split()[1]))
    c_api.stdin.close()
    figures = json.loads(c_api.stderr.read().strip().splitlines()[-1])
    if c_api.wait() != 0 or figures["output_tokens"] != max_tokens * sum(map(len, workload)):
        raise RuntimeError(f"batch_threads failed: {figures}")
    return c_seconds[1:], python_seconds[1:]  # (the first of each: a warm-up)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()

    vocab = 49152 if args.model is None else 32000
    # (a workload of its own for each run: prefix caching must find nothing)
    batch, batch_8 = (prompts(args.rounds, args.num_prompts, args.min_len, args.max_len, vocab,
                              seed) for seed in (0, 1))  # fmt: skip
    single = prompts(args.rounds, 1, args.min_len, args.min_len, vocab, 2)
    n, m = args.max_tokens, args.decode_tokens
    llm = LLM(args.model) if args.model else LLM()
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        binary = build_example(folder / "build")
        c_one, py_batch = in_turns(binary, args.model, llm, batch, n, 1, False, folder)
        c_eight, py_batch_8 = in_turns(binary, args.model, llm, batch_8, n, 8, False, folder)
        c_stream, py_single = in_turns(binary, args.model, llm, single, m, 1, True, folder)

    tokens = args.num_prompts * n
    cases = [
        ("offline, 1 submitting thread", min(c_one), min(py_batch), tokens),
        ("offline, 8 submitting threads", min(c_eight), min(py_batch_8), tokens),
        ("single-stream decode, callback", min(c_stream), min(py_single), m),
    ]
    rows = [(name, f"{t / c:.1f}", f"{t / p:.1f}", f"{p / c:.3f}") for name, c, p, t in cases]
    table = print_table(
        ("workload", "C API tokens/s", "LLM.generate tokens/s", "speedup vs Python API"), rows
    )
    figures = {
        "c_api_tokens_per_s": tokens / min(c_one),
        "c_api_8_threads_tokens_per_s": tokens / min(c_eight),
        "python_api_tokens_per_s": tokens / min(py_batch + py_batch_8),
        "c_api_decode_tokens_per_s": m / min(c_stream),
        "python_api_decode_tokens_per_s": m / min(py_single),
        "speedup_vs_python_api": min(py_batch) / min(c_one),
        "speedup_vs_python_api_8_threads": min(py_batch_8) / min(c_eight),
        "speedup_vs_python_api_decode": min(py_single) / min(c_stream),
    }
    report("c_api", figures, tables=[table])


if __name__ == "__main__":
    main()
