"""Structured outputs against none, in one run, on the default model (SmolLM2-135M-
Instruct): offline throughput (generated tokens/s) of 32 chat requests that each ask
for a JSON array of 60 short strings, with the JSON schema as their constraint and
without, sampled, 128 tokens each (the array is longer: every request runs to
max_tokens): at temperature 0.8 alone (a row is masked only where its grammar refuses
its draw) and with top-p 0.95 too (every row masked before it is drawn); and the
grammar's compile time per schema, cold (the grammar compiled anew, then a matcher's
first mask) and cached (the grammar kept). Target: constrained throughput at least 90%
of unconstrained.

The last line printed is one JSON object, also written to bench/results/structured.json.

    python -m bench.structured [--requests 32] [--max-tokens 128] [--rounds 3]

(from the repository root; bench/__init__.py says how with a plain install)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pyengine import LLM, SamplingParams, StructuredOutputsParams
from pyengine.engine.structured_output import GrammarCompiler

from .common import print_table, report

# Longer than max_tokens: both kinds generate as many tokens (the same batch throughout)
WORDS = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 60,
         "maxItems": 60}  # fmt: skip
SHORT = {"type": "string", "maxLength": 16}
# Schemas whose compile time is measured: from flat to nested.
SCHEMAS = {
    "flat object": {"type": "object", "properties": {"name": SHORT, "age": {"type": "integer"}},
                    "required": ["name", "age"], "additionalProperties": False},
    "enum and range": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["color", "score"]},
    "array of strings": WORDS,
    "nested objects": {"type": "object", "properties": {"user": {"type": "object",
        "properties": {"id": {"type": "integer"}, "email": SHORT,
                       "address": {"type": "object", "properties": {"city": SHORT,
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                   "required": ["city", "zip"]}},
        "required": ["id", "email", "address"]}}, "required": ["user"]},
    "array of objects": {"type": "array", "maxItems": 5, "items": {"type": "object",
        "properties": {"sku": SHORT, "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"], "additionalProperties": False}},
}  # fmt: skip


def timed(llm: LLM, messages: list, params: list[SamplingParams]) -> tuple[float, int]:  # type: ignore[type-arg]
    start = time.perf_counter()
    outputs = llm.chat(messages, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def compile_times(llm: LLM, rounds: int) -> dict[str, tuple[float, float]]:
    """Per schema: (cold, cached) milliseconds to a matcher's first mask: cold with the
    grammar compiled anew (llguidance's tokenizer, made once an engine, kept), cached
    with it kept."""
    compiler = GrammarCompiler(llm.get_tokenizer(), llm.llm_engine.model_config.vocab_size)
    compiler.matcher(StructuredOutputsParams(regex="a")).allowed()  # (the tokenizer)
    times = {}
    for name, schema in SCHEMAS.items():
        constraint = StructuredOutputsParams(json=schema)
        cold, cached = [], []
        for _ in range(rounds):
            compiler.forget_grammars()
            start = time.perf_counter()
            compiler.matcher(constraint).allowed()
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            compiler.matcher(constraint).allowed()
            cached.append(time.perf_counter() - start)
        times[name] = (1e3 * statistics.median(cold), 1e3 * statistics.median(cached))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="best of this many, each run")
    args = parser.parse_args()

    llm = LLM(max_model_len=1024, seed=0, max_num_seqs=max(32, args.requests))
    messages = [[{"role": "user", "content": f"Give 30 words about topic {i} as a JSON array "
                  "of strings."}] for i in range(args.requests)]  # fmt: skip
    constraint = StructuredOutputsParams(json=WORDS)

    def requests(top_p: float, constrained: bool) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.8, top_p=top_p, seed=i, max_tokens=args.max_tokens,
                               ignore_eos=not constrained,
                               structured_outputs=constraint if constrained else None)
                for i in range(args.requests)]  # fmt: skip

    # (kind: its requests, and the unconstrained kind it is compared with)
    kinds = {
        "unconstrained": (requests(1.0, False), "unconstrained"),
        "JSON schema": (requests(1.0, True), "unconstrained"),
        "unconstrained, top-p 0.95": (requests(0.95, False), "unconstrained, top-p 0.95"),
        "JSON schema, top-p 0.95": (requests(0.95, True), "unconstrained, top-p 0.95"),
    }
    llm.chat(messages[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    best = {k: 0.0 for k in kinds}
    for _ in range(args.rounds):  # alternating: the machine is shared
        for kind, (params, _) in kinds.items():
            llm.llm_engine.scheduler.kv_cache.reset_prefix_cache()
            seconds, tokens = timed(llm, messages, params)
            best[kind] = max(best[kind], tokens / seconds)
    compiled = compile_times(llm, args.rounds)
    llm.llm_engine.shutdown()

    fraction = {kind: best[kind] / best[peer] for kind, (_, peer) in kinds.items()}
    print(
        f"# Structured outputs: SmolLM2-135M-Instruct, {args.requests} requests, "
        f"{torch.get_num_threads()} threads, best of {args.rounds}\n"
    )
    tables = [
        print_table(
            ("requests", "generated tok/s", "of unconstrained (same sampling)"),
            [(kind, f"{best[kind]:.1f}", f"{fraction[kind]:.0%}") for kind in kinds],  # fmt: skip
        )
    ]
    print()
    tables.append(
        print_table(
            ("schema", "compile, cold (ms)", "cached (ms)"),
            [(name, f"{cold:.1f}", f"{cached:.2f}") for name, (cold, cached) in compiled.items()],
        )
    )
    figures: dict[str, float] = {
        "constrained_throughput_fraction": round(fraction["JSON schema"], 3),
        "constrained_tokens_per_s": round(best["JSON schema"], 1),
        "unconstrained_tokens_per_s": round(best["unconstrained"], 1),
        "constrained_top_p_throughput_fraction": round(fraction["JSON schema, top-p 0.95"], 3),
        "constrained_top_p_tokens_per_s": round(best["JSON schema, top-p 0.95"], 1),
        "unconstrained_top_p_tokens_per_s": round(best["unconstrained, top-p 0.95"], 1),
        "compile_ms_cold_median": round(statistics.median(c for c, _ in compiled.values()), 2),
        "compile_ms_cached_median": round(statistics.median(c for _, c in compiled.values()), 3),
    }
    report("structured", figures, tables=tables)


if __name__ == "__main__":
    main()
