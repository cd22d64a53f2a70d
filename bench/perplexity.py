"""Quality of quantized weights and KV caches: the default model's perplexity on a fixed
text (bench/data/perplexity_text.md, a snapshot of the start of docs/architecture.md),
each quantized form against the reference, in the same run.

The reference is the shipped file's weights, Q4_1 dequantized to float32, with a float32
KV cache: pyengine multiplies the Q4_1 blocks bit for bit as those float32 weights, so
the reference row is also the Q4_1 row. The other GGUF files are made from the Q4_1 one
by llama.cpp's llama-quantize (as bench/quantized.py makes them: --llama-bin, --cache):
their losses add to Q4_1's own, which no file here can show (the float weights the Q4_1
file was made from are not shipped). W8A8 is the reference's float32 weights in
compressed-tensors' int8 form (bench/checkpoints.py), activations quantized per token;
FP8 the same in its e4m3 form, activations e4m3 per token; GPTQ and AWQ the same weights
in their 4-bit formats, groups of 64, rounded to nearest (not their own searches). The
int8-activation row multiplies the Q4_1 blocks by activations quantized per block of 32
(quantized_activations="int8", llama.cpp's q8_0 arithmetic).

The text is scored in windows of --window tokens (the first token of each unscored):
perplexity = exp(mean negative log-likelihood), from prompt logprobs. With --llama-bin,
llama.cpp's llama-perplexity scores each file too (its own protocol: the second half of
each window only, so its figures differ), a check on each file's change.

The last line printed is one JSON object, also written to bench/results/perplexity.json.

    python -m bench.perplexity [--llama-bin DIR] [--window 512] [--cache DIR]
"""

from __future__ import annotations

import argparse
import gc
import math
import re
import subprocess
import tempfile
from pathlib import Path

from pyengine import LLM, SamplingParams
from pyengine.loader.resolve import DEFAULT_MODEL, resolve_path

from .checkpoints import default_model_folders
from .common import BENCH, print_table, report
from .quantized import quantized_file

TEXT = BENCH / "data" / "perplexity_text.md"


def perplexity(model: Path, windows: list[list[int]], window: int, **engine: object) -> float:
    # (float32 unless a row asks otherwise: the reference's exact mode, float32 activations)
    llm = LLM(str(model), max_model_len=window + 16, **{"dtype": "float32", **engine})  # type: ignore[arg-type]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    total, count = 0.0, 0
    for ids, out in zip(windows, outputs, strict=True):
        assert out.prompt_logprobs is not None
        for token, position in zip(ids[1:], out.prompt_logprobs[1:], strict=True):
            assert position is not None
            total -= position[token].logprob
            count += 1
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    return math.exp(total / count)


def llama_perplexity(llama_bin: Path, model: Path, window: int) -> float:
    command = [str(llama_bin / "llama-perplexity"), "-m", str(model), "-f", str(TEXT)]
    run = subprocess.run([*command, "-c", str(window)], capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
    if found is None:
        raise RuntimeError(f"llama-perplexity printed no estimate for {model}")
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-bin", type=Path, help="folder of llama-quantize")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "pyengine-bench-gguf"
    )
    args = parser.parse_args()

    source = resolve_path(DEFAULT_MODEL)
    tokenizer = LLM(str(source), max_model_len=64).get_tokenizer()
    ids = tokenizer.encode(TEXT.read_text(encoding="utf-8"))
    windows = [ids[i : i + args.window] for i in range(0, len(ids) - 1, args.window)]
    windows = [w for w in windows if len(w) > 1]

    runs: list[tuple[str, Path | None, dict[str, object]]] = [
        ("float32 (Q4_1 dequantized) = Q4_1 blocks, float32 KV", source, {}),
        ("Q4_1, bfloat16 KV cache", source, {"kv_cache_dtype": "bfloat16"}),
        ("Q4_1, float16 KV cache", source, {"kv_cache_dtype": "float16"}),
        ("Q4_1, fp8 e4m3 KV cache", source, {"kv_cache_dtype": "fp8"}),
        ("Q4_1, int8 KV cache (per token and head)", source, {"kv_cache_dtype": "int8"}),
        ("Q4_1, int8 activations (llama.cpp's q8_0)", source, {"quantized_activations": "int8"}),
        ("Q8_0 (from Q4_1)", quantized_file(source, "Q8_0", args.llama_bin, args.cache), {}),
        ("Q5_1 (from Q4_1)", quantized_file(source, "Q5_1", args.llama_bin, args.cache), {}),
        ("Q4_0 (from Q4_1)", quantized_file(source, "Q4_0", args.llama_bin, args.cache), {}),
        ("Q4_K_S (from Q4_1)", quantized_file(source, "Q4_K_S", args.llama_bin, args.cache), {}),
        ("W8A8 int8 (from the float32 weights)", default_model_folders(args.cache)["w8a8"], {}),
        ("FP8 e4m3 W8A8 (from the float32 weights)", default_model_folders(args.cache)["fp8"], {}),
        (
            "GPTQ 4-bit g64 (round to nearest, from the float32 weights)",
            default_model_folders(args.cache)["gptq"],
            {},
        ),
        (
            "AWQ 4-bit g64 (round to nearest, from the float32 weights)",
            default_model_folders(args.cache)["awq"],
            {},
        ),
    ]
    reference = llama_reference = None
    rows, figures = [], {}
    for name, path, engine in runs:
        if path is None:
            print(f"{name}: no file (llama-quantize makes it: --llama-bin)")
            continue
        value = perplexity(path, windows, args.window, **engine)
        reference = reference or value
        change = value / reference - 1
        key = name.split(" (")[0].split(",")[0].lower().replace(" ", "_")
        if "kv_cache_dtype" in engine:
            key += "_kv_" + str(engine["kv_cache_dtype"])
        if "quantized_activations" in engine:
            key += "_act_" + str(engine["quantized_activations"])
        figures[f"{key}_perplexity"] = round(value, 4)
        figures[f"{key}_change_vs_reference"] = round(change, 5)
        theirs = "-"
        if args.llama_bin is not None and not engine and path.suffix == ".gguf":
            peer = llama_perplexity(args.llama_bin, path, args.window)
            llama_reference = llama_reference or peer
            figures[f"{key}_llamacpp_change"] = round(peer / llama_reference - 1, 5)
            theirs = f"{peer:.4f} ({peer / llama_reference - 1:+.2%})"
        rows.append((name, f"{value:.4f}", f"{change:+.2%}", theirs))
    figures["scored_tokens"] = sum(len(w) - 1 for w in windows)
    print(
        f"# Perplexity: {DEFAULT_MODEL} on {TEXT.name} ({len(ids)} tokens, windows of "
        f"{args.window})\n"
    )
    table = print_table(
        ("weights, KV cache", "perplexity", "vs reference", "llama.cpp's (vs its Q4_1)"), rows
    )
    report("perplexity", figures, tables=[table])


if __name__ == "__main__":
    main()
