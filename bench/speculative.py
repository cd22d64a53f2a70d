"""Speculative decoding against none, in one run, on the default model (SmolLM2-135M-
Instruct, its GGUF weights): tokens/s of

- an input-grounded workload (each request asks the model, in its chat template, to
  repeat a given passage of bench/data/perplexity_text.md, so that its output repeats
  long spans of its prompt),
  one request at a time (single stream) and 8 at once;
- the random-token workload of bench/throughput.py at batch 32, where proposals are
  rarely right: speculation must not make it much slower;

with prompt-lookup (n-gram) drafts, suffix decoding and a draft model (the target's
first --draft-layers layers: SmolLM2 has no smaller sibling here), greedy, the same
tokens either way (checked); suffix decoding's tree of earlier outputs is emptied before each
timed run, so that it never holds the answers it is timed on. Decode
tokens/s counts each request's tokens after its first over the time from each batch's
last first token to its end (speculation speeds up decoding, not prefills); the
end-to-end ratio counts the prefills too. A table of acceptance (drafts accepted of those
proposed) and mean accepted length (tokens a verifying row gains a step) per workload and
method.
Targets: at least 2x single-stream decode tokens/s on the input-grounded workload; on
the random one no more than 5% slower.

The last line printed is one JSON object, also written to bench/results/speculative.json.

    python -m bench.speculative [--passages 8] [--output-len 128] [--rounds 3]
                                [--num-speculative-tokens 4] [--random-prompts 32]
                                [--draft-layers 10]

(from the repository root; bench/__init__.py says how with a plain install)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from pyengine import LLM, SamplingParams
from pyengine.tokenizer import PyengineTokenizer

from .common import print_table, report

TEXT = Path(__file__).resolve().parent / "data" / "perplexity_text.md"


def grounded_prompts(count: int, tokenizer: PyengineTokenizer) -> list[str]:
    """Requests to repeat a passage (a paragraph or list of the text) exactly, in the
    Instruct model's chat template, as a chat client sends them."""
    blocks = [b.strip() for b in TEXT.read_text().split("\n\n") if len(b.split()) >= 40]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Repeat the following text exactly.\n\n{block}"}],
            add_generation_prompt=True,
        )
        for block in (blocks[i % len(blocks)] for i in range(count))
    ]


def timed(
    llm: LLM,
    prompts: list,  # type: ignore[type-arg]
    params: SamplingParams,
    batch: int,
) -> tuple[float, float, list]:  # type: ignore[type-arg]
    """Seconds to generate for `prompts`, `batch` at a time; seconds of decoding alone
    (each batch from its last first token to its end: what speculation speeds up, the
    prefills not); and their tokens."""
    start = time.perf_counter()
    out, decoding = [], 0.0
    for i in range(0, len(prompts), batch):
        done = llm.generate(prompts[i : i + batch], params, use_tqdm=False)
        firsts = [o.metrics.first_token_time for o in done if o.metrics]
        ends = [o.metrics.finished_time for o in done if o.metrics]
        decoding += max(e for e in ends if e) - max(f for f in firsts if f)
        out += done
    return time.perf_counter() - start, decoding, [list(o.outputs[0].token_ids) for o in out]


METHODS = ("ngram", "suffix", "draft_layers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passages", type=int, default=8, help="input-grounded requests")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--random-prompts", type=int, default=32)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument(
        "--draft-layers", type=int, default=10, help="draft_model's draft: the first layers"
    )
    parser.add_argument("--rounds", type=int, default=3, help="best of this many, each run")
    args = parser.parse_args()

    engine = {"max_model_len": 1024, "seed": 0}

    def make(method: str) -> LLM:
        if method == "none":
            return LLM(**engine)  # type: ignore[arg-type]
        k = args.num_speculative_tokens
        config: dict[str, object] = {"method": method, "num_speculative_tokens": k}
        if method == "draft_layers":
            config = {**config, "method": "draft_model", "draft_layers": args.draft_layers}
        return LLM(**engine, speculative_config=config)  # type: ignore[arg-type]

    methods = ("none", *METHODS)
    llms = {m: make(m) for m in methods}
    grounded = grounded_prompts(args.passages, llms["none"].get_tokenizer())
    rng = np.random.default_rng(0)
    random_prompts = [{"prompt_token_ids": rng.integers(100, 49_000, int(n)).tolist()}
                      for n in rng.integers(64, 257, args.random_prompts)]  # fmt: skip
    grounded_params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    random_params = SamplingParams(temperature=0, max_tokens=args.random_output_len,
                                   ignore_eos=True)  # fmt: skip
    workloads = {
        "input-grounded, single stream": (
            grounded[: max(2, args.passages // 2)],
            grounded_params,
            1,
        ),
        "input-grounded, 8 at once": (grounded, grounded_params, 8),
        "random tokens, batch 32": (random_prompts, random_params, 32),
    }
    warm_up = [{"prompt_token_ids": [100, 200, 300]}]
    for llm in llms.values():
        llm.generate(warm_up, SamplingParams(max_tokens=4), use_tqdm=False)

    best = {(w, m): float("inf") for w in workloads for m in methods}
    best_decode = dict(best)
    acceptance: dict[tuple[str, str], tuple[float, float]] = {}
    generated: dict[str, int] = {}
    decoded: dict[str, int] = {}  # tokens after each request's first
    for _ in range(args.rounds):  # the runs alternate: the machine is shared
        for w, (prompts, params, batch) in workloads.items():
            results = {}
            for m in methods:
                llm = llms[m]
                llm.llm_engine.scheduler.kv_cache.reset_prefix_cache()
                if m == "suffix":  # (no earlier run's answers: the same prompts come again)
                    llm.llm_engine.scheduler.reset_suffix_cache()
                before = _stats(llm)
                seconds, decoding, results[m] = timed(llm, prompts, params, batch)
                best[(w, m)] = min(best[(w, m)], seconds)
                best_decode[(w, m)] = min(best_decode[(w, m)], decoding)
                if m != "none":
                    acceptance[(w, m)] = _acceptance(before, _stats(llm))
                    assert results[m] == results["none"], f"{w}: {m} changed the tokens"
            generated[w] = sum(len(t) for t in results["none"])
            decoded[w] = sum(len(t) - 1 for t in results["none"])
    for llm in llms.values():
        llm.llm_engine.shutdown()

    rows = []
    for w in workloads:
        for m in METHODS:
            none_decode = decoded[w] / best_decode[(w, "none")]
            decode = decoded[w] / best_decode[(w, m)]
            rate_of_accepted, length = acceptance[(w, m)]
            label = f"draft_layers={args.draft_layers}" if m == "draft_layers" else m
            rows.append((w, label, f"{none_decode:.1f}", f"{decode:.1f}",
                         f"{decode / none_decode:.2f}x",
                         f"{best[(w, 'none')] / best[(w, m)]:.2f}x", f"{rate_of_accepted:.0%}",
                         f"{length:.2f}"))  # fmt: skip
    print(
        f"# Speculative decoding (prompt lookup, suffix decoding, the target's first "
        f"{args.draft_layers} layers as a draft model; "
        f"{args.num_speculative_tokens} drafts at most, greedy): SmolLM2-135M-Instruct, "
        f"{torch.get_num_threads()} threads, best of {args.rounds}\n"
    )
    table = print_table(("workload", "method", "none decode tok/s", "decode tok/s",
                         "decode speedup", "end-to-end speedup", "acceptance",
                         "mean accepted length"), rows, num_text_columns=2)  # fmt: skip
    keys = {"input-grounded, single stream": "single_stream", "input-grounded, 8 at once":
            "concurrency_8", "random tokens, batch 32": "random_batch_32"}  # fmt: skip
    figures: dict[str, float] = {}
    for w, key in keys.items():
        for m in METHODS:
            figures[f"speedup_vs_no_speculation_{m}_{key}"] = round(
                best_decode[(w, "none")] / best_decode[(w, m)], 3
            )
            figures[f"end_to_end_speedup_vs_no_speculation_{m}_{key}"] = round(
                best[(w, "none")] / best[(w, m)], 3
            )
            figures[f"acceptance_rate_{m}_{key}"] = round(acceptance[(w, m)][0], 3)
            figures[f"mean_accepted_length_{m}_{key}"] = round(acceptance[(w, m)][1], 3)
    report("speculative", figures, tables=[table])


def _stats(llm: LLM) -> tuple[int, int, int]:
    s = llm.llm_engine.core.spec_stats
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


def _acceptance(before: tuple[int, int, int], after: tuple[int, int, int]) -> tuple[float, float]:
    """(drafts accepted of those proposed, mean tokens a verifying row gained) between two
    readings of the stats."""
    drafts, proposed, accepted = (a - b for a, b in zip(after, before, strict=True))
    return (accepted / proposed if proposed else 0.0, 1 + accepted / drafts if drafts else 0.0)


if __name__ == "__main__":
    main()
