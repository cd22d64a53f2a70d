"""Hybrid models with recurrent state: a request's memory, and the engines end to end.

The shape: transformers' default Qwen3_5MoeTextConfig (Qwen3.5-MoE: 40 layers, every
fourth full attention with 2 kv heads of 256, the others Gated DeltaNet of 16 key and
32 value heads of 128 with a convolution of 4; 256 experts of 512, 8 a token, and a
shared expert of 512), SmolLM2's vocabulary and tokenizer.

Memory: the bytes one request holds at 1k, 32k and 128k tokens, a bfloat16 KV cache and
float32 states, against the same 40 layers all full attention. The KV figures are what
pyengine's KV-cache manager holds for the model's KVLayout (bench/attention_variants.py's
held_blocks: prefill in chunks, then decode steps); the state is one slot of every
recurrent layer (worker/state_pool.py), the same at every length.

Engines (--engines): a dummy-weight model of that shape with its first --layers layers,
as a Qwen3-Next checkpoint (Qwen3.5-MoE's computation, its projections laid out as
Qwen3-Next's: vLLM's CPU build cannot import its Qwen3.5 module without torchvision,
whose PyPI wheel does not load beside the CPU build of torch), each engine in a process
of its own: offline, --num-prompts prompts of --min-len to --max-len random tokens and
--output-len greedy tokens each, through pyengine and vLLM's CPU build (--vllm-python)
at their defaults (bfloat16), and transformers' generate in bfloat16 on random weights
(--transformers); one stream of --stream-len tokens after a --stream-prompt-len-token
prompt through each server (its TTFT is the second request's of that prompt, once warm:
pyengine's resumes the prompt from its prefix cache, the states from a checkpoint,
where vLLM's CPU build, in the recorded run, computed it again); and pyengine's stream
after a --short-prompt-len-token prompt too, whose decode rate against the long one's
shows what the context costs a token.

    python -m bench.hybrid [--contexts 1024,32768,131072] [--engines] [--layers 4]
                           [--vllm-python PY] [--transformers] [--num-prompts 32]
                           [--min-len 64] [--max-len 512] [--output-len 128]
                           [--stream-prompt-len 32768] [--short-prompt-len 1024]
                           [--stream-len 64]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from pyengine.config import RECURRENT_SPEC
from pyengine.worker.kv_layout import plan_kv_layout

from .attention_variants import compare_engines, held_blocks
from .checkpoints import default_model_folders
from .common import add_workload_arguments, print_table, report
from .cpu_peers import Model, one_stream, pyengine_server
from .shape_checkpoints import VOCAB
from .variant_checkpoints import variant_folder

# transformers' default Qwen3_5MoeTextConfig (its sizes; SmolLM2's vocabulary), as a
# Qwen3-Next checkpoint.
QWEN3_5_MOE: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "vocab_size": VOCAB, "hidden_size": 2048, "intermediate_size": 512,
    "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25},
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}  # fmt: skip


def layer_types(layers: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]


def state_bytes(config: dict[str, Any], layers: int) -> int:
    """One request's float32 states in the Gated DeltaNet layers among `layers`: the
    convolution's last inputs and the [value heads, key dim, value dim] state."""
    keys = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    values = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    conv = (2 * keys + values) * (config["linear_conv_kernel_dim"] - 1)
    state = (
        config["linear_num_value_heads"]
        * config["linear_key_head_dim"]
        * config["linear_value_head_dim"]
    )
    recurrent = layer_types(layers).count("linear_attention")
    return recurrent * (conv + state) * 4


def memory_table(args: argparse.Namespace, figures: dict[str, Any]) -> str:
    layers = QWEN3_5_MOE["num_hidden_layers"]
    kinds = layer_types(layers)
    hybrid = plan_kv_layout([RECURRENT_SPEC if k == "linear_attention" else ("full", 0)
                             for k in kinds])  # fmt: skip
    full = plan_kv_layout([("full", 0)] * layers)
    page = 2 * QWEN3_5_MOE["num_key_value_heads"] * QWEN3_5_MOE["head_dim"] * args.block_size * 2
    state = state_bytes(QWEN3_5_MOE, layers)
    figures["state_mib_per_request"] = round(state / 2**20, 2)
    rows = []
    for context in args.contexts:
        blocks = sum(held_blocks(hybrid, context, args.block_size, args.chunk, args.decode))
        every = sum(held_blocks(full, context, args.block_size, args.chunk, args.decode))
        kv = blocks * hybrid.num_slots * page
        ours, theirs = kv + state, every * full.num_slots * page
        figures[f"request_mib_{context}"] = round(ours / 2**20, 2)
        figures[f"request_mib_full_attention_{context}"] = round(theirs / 2**20, 2)
        figures[f"memory_saving_{context}"] = round(theirs / ours, 2)
        rows.append((f"{context:,}", f"{kv / 2**20:,.1f}", f"{state / 2**20:,.1f}",
                     f"{ours / 2**20:,.1f}", f"{theirs / 2**20:,.1f}",
                     f"{theirs / ours:.2f}x"))  # fmt: skip
    linear, attention = kinds.count("linear_attention"), kinds.count("full_attention")
    print(f"\nOne request's memory, Qwen3.5-MoE's shape ({layers} layers: {linear} Gated "
          f"DeltaNet, {attention} full attention; bfloat16 KV in blocks of {args.block_size}, "
          "float32 states)")  # fmt: skip
    return print_table(("context", "attention KV MiB", "state MiB", "hybrid MiB",
                        "all full attention MiB", "saving"), rows)  # fmt: skip


def short_stream(folder: Path, args: argparse.Namespace, figures: dict[str, Any]) -> str:
    """pyengine's decode rate after a short prompt, against the long prompt's (the
    stream compare_engines ran)."""
    rng = np.random.default_rng(args.seed + 1)
    prompt = rng.integers(100, VOCAB - 100, args.short_prompt_len).tolist()
    command, port = pyengine_server(Model("qwen3.5-moe", folder, "dummy", None, 0), "auto", args)
    short = one_stream(command, {}, port, prompt, args, "pyengine")["decode_tok_s"]
    print(f"pyengine stream after {args.short_prompt_len} tokens: {short:.2f} tok/s", flush=True)
    long = figures["engines_qwen35_moe"]["stream"]["pyengine"]["decode_tok_s"]
    figures["decode_tok_s_short_context"] = round(short, 2)
    figures["decode_tok_s_long_context"] = round(long, 2)
    figures["decode_long_over_short"] = round(long / short, 3)
    rates = {args.short_prompt_len: short, args.stream_prompt_len: long}
    print(f"\npyengine's decode rate by context (--layers {args.layers})")
    rows = [(f"{n:,}", f"{r:.2f}", f"{r / short:.0%}") for n, r in rates.items()]
    return print_table(("context", "decode tok/s", "of the short context's"), rows)


def main() -> None:
    parser = add_workload_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--contexts", default="1024,32768,131072")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--decode", type=int, default=16, help="decode steps at the end")
    parser.add_argument("--engines", action="store_true", help="the model end to end")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vllm-python", help="the Python of vLLM's CPU build")
    parser.add_argument("--transformers", action="store_true")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--stream-prompt-len", type=int, default=32768)
    parser.add_argument("--short-prompt-len", type=int, default=1024)
    parser.add_argument("--stream-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=33792)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache/pyengine-bench")
    args = parser.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    figures: dict[str, Any] = {}
    tables = [memory_table(args, figures)]
    if args.engines:
        config = {**QWEN3_5_MOE, "num_hidden_layers": args.layers,
                  "layer_types": layer_types(args.layers)}  # fmt: skip
        tokenizer = default_model_folders(args.cache)["float32"]
        folder = variant_folder(f"qwen3.5-moe-{args.layers}", config, tokenizer, args.cache)
        name = f"Qwen3.5-MoE ({args.layers} layers)"
        tables += compare_engines({name: folder}, args, figures)
        tables.append(short_stream(folder, args, figures))
        offline = figures.get("speedup_vs_vllm_offline_qwen35_moe")
        if offline is not None:
            figures["target_offline_1_2x_vllm"] = bool(offline >= 1.2)
    report("hybrid", figures, tables=tables)


if __name__ == "__main__":
    main()
