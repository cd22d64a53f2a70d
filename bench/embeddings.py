"""Embeddings per second: --num-texts texts of --min-len to --max-len random tokens, each
embedded whole, through pyengine, vLLM's CPU build (--vllm-python) and transformers
(--transformers), each at its fastest default.

Two shapes, dummy weights (a config.json in the cache folder, SmolLM2's vocabulary and
tokenizer; random weights make the times of trained ones): BERT-base (BertModel, [CLS]
pooling) and Qwen3-Embedding-0.6B (Qwen3ForCausalLM run as an embedder, last-token
pooling), both at max_model_len 512. pyengine and vLLM run in processes of their own
(bench/embedding_peer.py), at dtype "auto" (bfloat16 on a CPU with AVX512-BF16 or AMX
for both); transformers runs in this process in bfloat16 (its fastest here), as
sentence-transformers does: the texts sorted by length, batches of --hf-batch padded to
their longest, the pooled rows normalised; and, on the first --float32-texts texts, in
float32, its default and sentence-transformers', against pyengine on the same texts.
The figure is texts/s of the whole batch, best of --rounds; the comparisons are peer
time / pyengine time.

    python -m bench.embeddings [--num-texts 512] [--min-len 32] [--max-len 512]
                               [--vllm-python PY] [--transformers] [--float32-texts 64]
                               [--rounds 1] [--models bert-base,qwen3-embedding-0.6b]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoints import default_model_folders
from .common import print_table, report
from .cpu_peers import peer_figures
from .shape_checkpoints import VOCAB
from .variant_checkpoints import variant_folder

PEER_SCRIPT = Path(__file__).with_name("embedding_peer.py")

MODELS: dict[str, dict[str, Any]] = {
    "bert-base": {
        "pooling": "CLS",
        "config": {
            "architectures": ["BertModel"], "model_type": "bert", "vocab_size": 30522,
            "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
            "intermediate_size": 3072, "hidden_act": "gelu", "max_position_embeddings": 512,
            "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0,
        },
    },
    "qwen3-embedding-0.6b": {
        "pooling": "LAST",
        "config": {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151669,
            "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
            "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 151643,
            "eos_token_id": 151643, "torch_dtype": "bfloat16",
        },
    },
}  # fmt: skip
MAX_MODEL_LEN = 512


def model_folder(name: str, cache: Path) -> Path:
    """A folder of the shape's config.json (the engines draw dummy weights) with SmolLM2's
    vocabulary and tokenizer (vLLM's pooling runner loads one; the prompts are ids)."""
    config = {**MODELS[name]["config"], "vocab_size": VOCAB}
    return variant_folder(f"embedding-{name}", config, default_model_folders(cache)["float32"],
                          cache)  # fmt: skip


def engine_run(python: str, engine: str, folder: Path, name: str, prompts: list[list[int]],
               args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    job = {
        "engine": engine, "model": str(folder), "dtype": "auto", "max_model_len": MAX_MODEL_LEN,
        "pooling_type": MODELS[name]["pooling"], "prompts": prompts, "rounds": args.rounds,
    }  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": "2"}
    return peer_figures(python, PEER_SCRIPT, job, env, f"{engine} on {name}")


def transformers_run(
    name: str, prompts: list[list[int]], args: argparse.Namespace, dtype: torch.dtype
) -> dict[str, Any]:
    """transformers' model in `dtype`, as sentence-transformers runs it."""
    import transformers

    config = transformers.AutoConfig.for_model(**{**MODELS[name]["config"], "vocab_size": VOCAB})
    hf = transformers.AutoModel.from_config(config, dtype=dtype).eval()
    last = MODELS[name]["pooling"] == "LAST"
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    best = float("inf")
    for _ in range(args.rounds):
        start = time.perf_counter()
        with torch.inference_mode():
            for i in range(0, len(order), args.hf_batch):
                group = [prompts[j] for j in order[i : i + args.hf_batch]]
                width = max(map(len, group))
                ids = torch.zeros(len(group), width, dtype=torch.long)
                mask = torch.zeros(len(group), width, dtype=torch.long)
                for row, p in enumerate(group):  # (left padding: the last token in place)
                    ids[row, width - len(p) :] = torch.tensor(p)
                    mask[row, width - len(p) :] = 1
                hidden = hf(input_ids=ids, attention_mask=mask).last_hidden_state
                pooled = hidden[:, -1] if last else hidden[torch.arange(len(group)),
                                                           width - mask.sum(1)]  # fmt: skip
                torch.nn.functional.normalize(pooled.float(), dim=-1)
        best = min(best, time.perf_counter() - start)
    del hf
    return {"startup_s": None, "texts_per_s": len(prompts) / best, "resident_mib": None}


def compare(
    name: str, prompts: list[list[int]], args: argparse.Namespace, peers: dict[str, Any],
    figures: dict[str, Any], suffix: str = "",
) -> list[tuple[str, ...]]:  # fmt: skip
    """pyengine and each peer (label -> its run on the prompts) as table rows; the
    figures, each name ending in `suffix`."""
    folder = model_folder(name, args.cache)
    runs = {"pyengine": engine_run("python", "pyengine", folder, name, prompts, args)}
    runs.update({label: run(folder) for label, run in peers.items()})
    ours = runs["pyengine"]["texts_per_s"]
    key = name.replace("-", "_").replace(".", "_") + suffix
    rows = []
    for engine, run in runs.items():
        ratio = ours / run["texts_per_s"]
        start, memory = run["startup_s"], run["resident_mib"]
        rows.append((name, engine, f"{run['texts_per_s']:.2f}", f"{ratio:.2f}",
                     "" if start is None else f"{start:.1f}",
                     "" if memory is None else f"{memory:.0f}"))  # fmt: skip
        label = engine.lower().replace(" (", "_").replace(")", "")
        figures[f"texts_per_s_{label}_{key}"] = round(run["texts_per_s"], 3)
        if engine != "pyengine":
            figures[f"speedup_vs_{label}_{key}"] = round(ratio, 3)
    return rows


HEADER = ("model shape", "engine", "texts/s", "pyengine / it", "start-up (s)", "resident MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-texts", type=int, default=512)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--models", default="bert-base,qwen3-embedding-0.6b")
    parser.add_argument("--vllm-python", help="the Python of vLLM's CPU build")
    parser.add_argument("--transformers", action="store_true")
    parser.add_argument(
        "--float32-texts",
        type=int,
        default=64,
        help="transformers at its default, float32, on this many texts",
    )
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache/pyengine-bench")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_len, args.max_len + 1, args.num_texts)
    few = args.float32_texts
    figures: dict[str, Any] = {"num_texts": args.num_texts, "prompt_tokens": int(lengths.sum()),
                               "float32_texts": few}  # fmt: skip
    rows: list[tuple[str, ...]] = []
    float32_rows: list[tuple[str, ...]] = []
    for name in args.models.split(","):
        prompts = [rng.integers(1000, VOCAB, n).tolist() for n in lengths]
        peers: dict[str, Any] = {}
        if args.vllm_python:
            peers["vLLM"] = lambda f, n=name, p=prompts: engine_run(
                args.vllm_python, "vllm", f, n, p, args
            )
        if args.transformers:
            peers["transformers (bfloat16)"] = lambda f, n=name, p=prompts: transformers_run(
                n, p, args, torch.bfloat16
            )
        rows += compare(name, prompts, args, peers, figures)
        if args.transformers and few:
            float32 = {"transformers (float32)": lambda f, n=name, p=prompts[:few]: (
                transformers_run(n, p, args, torch.float32))}  # fmt: skip
            float32_rows += compare(name, prompts[:few], args, float32, figures, "_few")
    print(f"{args.num_texts} texts of {args.min_len}-{args.max_len} tokens "
          f"({figures['prompt_tokens']} tokens), embedded whole")  # fmt: skip
    tables = [print_table(HEADER, rows, num_text_columns=2)]
    if float32_rows:
        print(f"\nThe first {few} of them, against transformers at its default (float32)")
        tables.append(print_table(HEADER, float32_rows, num_text_columns=2))
    report("embeddings", figures, tables=tables)


if __name__ == "__main__":
    main()
