"""docs/benchmarks.md from the figures the benchmarks wrote to bench/results/*.json: one
section per benchmark (what it measures, from its docstring; its tables; the command, date,
commit and machine), and a headline table, which also replaces README.md's block between
the lines `<!-- bench:headline:begin -->` and `<!-- bench:headline:end -->` where README.md
has them. Nothing here is typed by hand: rerun a benchmark, then this.

    python -m bench.docs [--results bench/results] [--output docs/benchmarks.md]
                         [--readme README.md]

(imports no pyengine: runs from the repository root whatever the install)
"""

from __future__ import annotations

import argparse
import ast
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import BENCH, RESULTS

ROOT = BENCH.parent
BEGIN, END = "<!-- bench:headline:begin -->", "<!-- bench:headline:end -->"
# Sections in this order; results of other benchmarks follow, by name.
ORDER = (
    "kv_cache",
    "scheduler",
    "attention_cpu",
    "throughput",
    "cpu_peers",
    "quantized",
    "perplexity",
    "distributed",
    "lora",
    "speculative",
    "structured",
    "serve",
    "c_api",
    "soak",
    "hostile",
    "gpu_kernels",
    "gpu_kernels_attention",
    "gpu_throughput",
    "gpu_sass_mix",
)


@dataclass(frozen=True)
class Headline:
    benchmark: str
    label: str
    value: Callable[[dict[str, Any]], float | None]  # from the figures; None: not measured
    unit: str  # "x" for a ratio


def figure(key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda figures: figures.get(key)


def percent(key: str) -> Callable[[dict[str, Any]], float | None]:
    """A share (0 to 1) in the figures, as a percentage."""
    return as_percent(lambda figures: figures.get(key))


def as_percent(
    share: Callable[[dict[str, Any]], float | None],
) -> Callable[[dict[str, Any]], float | None]:
    def pick(figures: dict[str, Any]) -> float | None:
        value = share(figures)
        return None if value is None else 100 * value

    return pick


def smallest(prefix: str, suffix: str = "") -> Callable[[dict[str, Any]], float | None]:
    def pick(figures: dict[str, Any]) -> float | None:
        values = [
            v
            for k, v in figures.items()
            if k.startswith(prefix) and k.endswith(suffix) and v is not None
        ]
        return min(values) if values else None

    return pick


def least(*keys: str) -> Callable[[dict[str, Any]], float | None]:
    """The least of these figures that were measured."""

    def pick(figures: dict[str, Any]) -> float | None:
        values = [figures[k] for k in keys if figures.get(k) is not None]
        return min(values) if values else None

    return pick


def engines_mla_prefill(figures: dict[str, Any]) -> float | None:
    """The speedup of the form the engine took on the measuring CPU: the absorbed one on
    AMX's tiles, the expanded one elsewhere."""
    form = "tiles_vs_expanded" if figures.get("amx") else "expanded_vs_no_amx"
    value = figures.get(f"speedup_{form}_q4096_ctx4096")
    return float(value) if value is not None else None


def ratio(figures: dict[str, Any], numerator: str, denominator: str) -> float | None:
    top, bottom = figures.get(numerator), figures.get(denominator)
    return None if top is None or not bottom else round(top / bottom, 2)


HEADLINES = (
    Headline(
        "kv_cache",
        "KV-cache allocate/free driven from C++, against pure Python",
        figure("speedup_vs_python_alloc_free"),
        "x",
    ),
    Headline("kv_cache", "prefix hash, µs per 1k tokens", figure("cpp_hash_us_per_1k_tokens"), ""),
    Headline("scheduler", "scheduler step, 256 requests, µs", figure("us_per_step_256"), ""),
    Headline(
        "scheduler",
        "scheduler step against pure Python, least of 64/256/1024 requests",
        figure("min_speedup_vs_python"),
        "x",
    ),
    Headline(
        "attention_cpu",
        "CPU decode attention against torch SDPA, slowest case",
        smallest("speedup_vs_sdpa_decode"),
        "x",
    ),
    Headline(
        "throughput",
        "CPU offline generated tokens/s, against transformers",
        figure("speedup_vs_hf_generated_tok_s"),
        "x",
    ),
    Headline(
        "cpu_peers",
        "CPU offline generated tokens/s at both engines' defaults, against vLLM's CPU build, "
        "least of the default model, Llama-3.2-1B's and 3B's shapes",
        least(*(f"speedup_vs_vllm_offline_{m}" for m in ("default", "1b", "3b"))),
        "x",
    ),
    Headline(
        "cpu_peers",
        "the same, vLLM's threads on every core (its default leaves one to its frontend)",
        least(*(f"speedup_vs_vllm_every_core_offline_{m}" for m in ("default", "1b", "3b"))),
        "x",
    ),
    Headline(
        "cpu_peers",
        "the same on int8 W8A8 checkpoints of the 1B and 3B shapes, both engines reading them",
        smallest("speedup_vs_vllm_offline_", "_w8a8"),
        "x",
    ),
    Headline(
        "cpu_peers",
        "CPU single-stream decode through each server at the defaults, against vLLM's, least "
        "of the three models and the W8A8 checkpoints",
        smallest("speedup_vs_vllm_stream_"),
        "x",
    ),
    Headline(
        "cpu_peers",
        "single-stream decode against llama.cpp's server on the same GGUF file (its --no-repack "
        "layouts: its native build crashes on this AMX CPU), least of the default model and "
        "the 1B/3B shapes' Q4_1 and Q8_0",
        smallest("speedup_vs_llamacpp_stream_"),
        "x",
    ),
    Headline(
        "cpu_peers",
        "single-stream decode of Llama-3.2-3B's shape, against its bfloat16 bound (weight bytes "
        "over the read rate of torch's float32 sum, which pyengine's decode exceeds)",
        percent("stream_share_of_bf16_bound_3b"),
        "%",
    ),
    Headline(
        "cpu_peers",
        "the same for its int8 (W8A8) and 4- and 8-bit GGUF (Q4_1, Q8_0) checkpoints, least",
        as_percent(smallest("stream_share_of_bound_3b_")),
        "%",
    ),
    Headline(
        "moe",
        "mixture of experts (Qwen3-30B-A3B's layer shapes, 4 layers): CPU offline generated "
        "tokens/s against vLLM's CPU build at its default (bfloat16)",
        figure("speedup_vs_vllm_offline"),
        "x",
    ),
    Headline(
        "moe",
        "the same, single-stream decode against llama.cpp's server (--no-repack), least of "
        "bfloat16 and the same Q8_0 file",
        smallest("speedup_vs_llamacpp_stream_"),
        "x",
    ),
    Headline(
        "attention_variants",
        "hybrid KV cache: a Gemma-3-1B-shaped request's KV bytes at 32k tokens, all-full "
        "attention's over the hybrid cache's",
        figure("kv_saving_gemma_3_1b_32768"),
        "x",
    ),
    Headline(
        "attention_variants",
        "CPU offline generated tokens/s against vLLM's CPU build, least of Gemma-3-1B's and "
        "DeepSeek-V2-Lite's shapes (dummy weights)",
        smallest("speedup_vs_vllm_offline_"),
        "x",
    ),
    Headline(
        "attention_variants",
        "MLA decode attention from memory (DeepSeek-V2-Lite's shape, bfloat16, the CPU's "
        "caches flushed each call), least share of its bandwidth bound",
        as_percent(smallest("mla_decode_bandwidth_share_")),
        "%",
    ),
    Headline(
        "mla_prefill",
        "MLA prefill of a 4k-token prompt (DeepSeek-V2-Lite's shape, bfloat16): the form "
        "the engine takes against the other (absorbed on AMX's tiles, else expanded)",
        engines_mla_prefill,
        "x",
    ),
    Headline(
        "hybrid",
        "hybrid model with recurrent state: a Qwen3.5-MoE-shaped request's memory at 128k "
        "tokens, all-full attention's over the hybrid's (its KV and state)",
        figure("memory_saving_131072"),
        "x",
    ),
    Headline(
        "hybrid",
        "the same shape (4 layers, dummy weights): CPU offline generated tokens/s against "
        "vLLM's CPU build",
        figure("speedup_vs_vllm_offline_qwen35_moe"),
        "x",
    ),
    Headline(
        "quantized",
        "CPU single-stream decode (streamed), int8 activations as llama.cpp's, against "
        "llama.cpp's server, slowest of Q4_0/Q4_1/Q8_0",
        smallest("speedup_vs_llamacpp_", "_server_int8"),
        "x",
    ),
    Headline(
        "quantized",
        "the same, float32 activations (the dequantized weights' exact product)",
        smallest("speedup_vs_llamacpp_", "_server"),
        "x",
    ),
    Headline(
        "quantized",
        "resident memory, Q4_1 model loaded in the server, against llama.cpp's",
        lambda f: ratio(f, "q4_1_pyengine_server_rss_mib", "q4_1_llamacpp_server_rss_mib"),
        "x",
    ),
    Headline(
        "quantized",
        "CPU batched generated tokens/s, INT8 W8A8 weights, against OpenVINO GenAI's default",
        figure("speedup_vs_openvino_batched_w8a8"),
        "x",
    ),
    Headline(
        "quantized",
        "the same with an int8 KV cache (OpenVINO's default has an 8-bit one)",
        figure("speedup_vs_openvino_batched_w8a8_kv_int8"),
        "x",
    ),
    Headline(
        "perplexity",
        "Q8_0 weights: perplexity change against the float32 reference",
        percent("q8_0_change_vs_reference"),
        "%",
    ),
    Headline(
        "distributed",
        "CPU TP=2: all-reduce share of the step time (2 ranks, shared memory)",
        percent("tp2_allreduce_share"),
        "%",
    ),
    Headline(
        "lora",
        "CPU offline tokens/s, 8 rank-16 LoRA adapters mixed, share of the base model's",
        percent("mixed_share_of_base"),
        "%",
    ),
    Headline("serve", "server output tokens/s over HTTP", figure("serve_output_tok_s"), ""),
    Headline(
        "c_api",
        "the C API against the Python API (LLM.generate), least of offline throughput from 1 "
        "and from 8 submitting threads and single-stream decode through a callback",
        least(
            "speedup_vs_python_api",
            "speedup_vs_python_api_8_threads",
            "speedup_vs_python_api_decode",
        ),
        "x",
    ),
    Headline(
        "gpu_throughput",
        "GPU offline generated tokens/s, against transformers",
        figure("speedup_vs_hf_generated_tok_s"),
        "x",
    ),
)


def load_results(folder: Path) -> dict[str, dict[str, Any]]:
    """Every bench/results/<name>.json, by name, in ORDER."""
    results = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
    rank = {name: i for i, name in enumerate(ORDER)}
    return dict(sorted(results.items(), key=lambda kv: (rank.get(kv[0], len(ORDER)), kv[0])))


def docstring(module: str | None) -> str:
    """The benchmark module's docstring, read from its file (nothing is imported)."""
    if not module or not module.startswith("bench."):
        return ""
    path = BENCH.joinpath(*module.split(".")[1:]).with_suffix(".py")
    if not path.exists():
        return ""
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def description(doc: str) -> tuple[str, str]:
    """(summary line, what it measures): the docstring without its usage paragraphs (an
    indented `python ...` command, a parenthesised note on how to run it)."""
    paragraphs = [p for p in doc.strip().split("\n\n") if p.strip()]
    if not paragraphs:
        return "", ""
    summary, *rest = paragraphs
    kept = [
        "\n".join(line.strip() for line in p.splitlines())
        for p in rest
        if not p.startswith("    ") and not p.startswith("(")
    ]
    return " ".join(summary.split()), "\n\n".join(kept)


def format_value(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and unit == "x" and abs(value) < 10:
        text = f"{value:.2f}"  # (a ratio of 1.0 as 1.00x, as the tables print it)
    elif isinstance(value, float):
        text = f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    elif isinstance(value, int):
        text = f"{value:,}"
    else:
        text = str(value)
    return text + unit


def machine_text(machine: dict[str, Any]) -> str:
    parts = [f"{machine.get('cpu', 'unknown CPU')}, {machine.get('cores', '?')} cores"]
    if machine.get("device"):
        parts.insert(0, str(machine["device"]))
    if machine.get("load_average_1m") is not None:
        parts.append(f"load average {machine['load_average_1m']} (1 min) at the end")
    if machine.get("environment"):
        parts.append(", ".join(f"{k}={v}" for k, v in machine["environment"].items()))
    return "; ".join(parts)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> str:
    """A markdown table; align has one letter per column: l (text) or r (figures)."""
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = [header, rule, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def headline_table(results: dict[str, dict[str, Any]]) -> str:
    rows = []
    for h in HEADLINES:
        result = results.get(h.benchmark)
        if result is None:
            continue
        value = h.value(result["figures"])
        if value is None:
            continue
        m = result["machine"]
        machine = m.get("device") or f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores"
        date = result["date"][:10]
        rows.append((h.label, format_value(value, h.unit), f"`{h.benchmark}`", machine, date))
    if not rows:
        return "(no benchmark results yet: run one, then `python -m bench.docs`)"
    return markdown_table(("figure", "value", "benchmark", "machine", "date"), rows, "lrlll")


def section(name: str, result: dict[str, Any]) -> str:
    summary, body = description(docstring(result.get("module")))
    lines = [f"## `{name}`" + (f": {summary}" if summary else ""), ""]
    if body:
        lines += [body, ""]
    commit = f", commit `{result['commit']}`" if result.get("commit") else ""
    lines += [
        f"Measured {result['date']}{commit}, with `{result['command']}`, on",
        f"{machine_text(result['machine'])}.",
        "",
    ]
    for table in result.get("tables", []):
        lines += [table, ""]
    figures = result["figures"]
    rows = [(f"`{key}`", format_value(value)) for key, value in figures.items()]
    lines += [
        "<details><summary>All figures (bench/results/" + name + ".json)</summary>",
        "",
        markdown_table(("figure", "value"), rows, "lr"),
        "",
        "</details>",
        "",
    ]
    return "\n".join(lines)


def benchmarks_md(results: dict[str, dict[str, Any]]) -> str:
    head = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python -m bench.docs` from bench/results/*.json: do not edit. -->",
        "Generated by `python -m bench.docs` from the JSON the benchmarks write to",
        "bench/results/ (bench/common.py); rerun a benchmark with the command its section",
        "gives, then `python -m bench.docs`. Figures hold for the machine, and the load on it,",
        "named in each section.",
        "",
        "## Headline",
        "",
        headline_table(results),
        "",
    ]
    return "\n".join(head + [section(name, r) for name, r in results.items()]).rstrip() + "\n"


def replace_headline(readme: str, table: str) -> str | None:
    """README text with the block between BEGIN and END replaced, or None without them."""
    lines = readme.splitlines(keepends=True)
    stripped = [line.strip() for line in lines]
    if BEGIN not in stripped or END not in stripped:
        return None
    begin, end = stripped.index(BEGIN), stripped.index(END)
    if end < begin:
        raise ValueError(f"README: {END} comes before {BEGIN}")
    details = "[docs/benchmarks.md](docs/benchmarks.md)"
    note = f"Generated by `python -m bench.docs`; details in {details}.\n"
    block = ["\n", table + "\n", "\n", note, "\n"]
    return "".join(lines[: begin + 1] + block + lines[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    args = parser.parse_args()
    results = load_results(args.results)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(benchmarks_md(results))
    print(f"wrote {args.output} ({len(results)} benchmarks)")
    if args.readme.exists():
        text = replace_headline(args.readme.read_text(), headline_table(results))
        if text is None:
            print(f"{args.readme}: no {BEGIN} / {END} lines, left as it is")
        else:
            args.readme.write_text(text)
            print(f"rewrote the headline block of {args.readme}")


if __name__ == "__main__":
    main()
