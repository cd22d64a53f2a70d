"""A mixture-of-experts model of Qwen3-30B-A3B's layer shapes (hidden 2048, 32 heads of
128 over 4 KV heads, 128 experts of size 768, top 8) with a few layers and SmolLM2's
vocabulary and tokenizer, for bench/moe.py:

- a Hugging Face folder of its config.json and the tokenizer: what the engines' dummy
  loaders read (random weights at load);
- a GGUF file (llama.cpp's qwen3moe) of random weights in bfloat16 (norms float32),
  drawn tensor by tensor from a seeded generator, and that file quantized by llama.cpp's
  llama-quantize (Q8_0).

Random weights make the times of a trained model (every layer runs, the router spreads
the tokens over the experts); their tokens mean nothing, and the engines that load
dummy weights draw their own: the same shapes and bytes, not the same values.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .shape_checkpoints import VOCAB, add_default_tokenizer, random_tensor

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, TOP_K, EXPERT_SIZE = 128, 8, 768


def hf_config(layers: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 6144,
        "moe_intermediate_size": EXPERT_SIZE, "num_hidden_layers": layers,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }  # fmt: skip


def moe_folder(layers: int, tokenizer_folder: Path, cache: Path) -> Path:
    folder = cache / f"qwen3-30b-a3b-shape-{layers}-layers"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(layers)))
    shutil.copy(tokenizer_folder / "tokenizer.json", folder / "tokenizer.json")
    return folder


def decode_bytes(layers: int) -> int:
    """Weight bytes one decode token reads in bfloat16: each layer's attention, router
    and top-k experts, and the head."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    per_layer = HIDDEN * (q + 2 * kv) + q * HIDDEN + EXPERTS * HIDDEN
    per_layer += TOP_K * 3 * HIDDEN * EXPERT_SIZE
    return 2 * (layers * per_layer + VOCAB * HIDDEN)


def gguf_tensors(layers: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(llama.cpp name, numpy shape) of every tensor, tied head."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    yield "token_embd.weight", (VOCAB, HIDDEN)
    yield "output_norm.weight", (HIDDEN,)
    for i in range(layers):
        for name, shape in (
            ("attn_norm", (HIDDEN,)), ("attn_q", (q, HIDDEN)), ("attn_k", (kv, HIDDEN)),
            ("attn_v", (kv, HIDDEN)), ("attn_output", (HIDDEN, q)),
            ("attn_q_norm", (HEAD_DIM,)), ("attn_k_norm", (HEAD_DIM,)),
            ("ffn_norm", (HIDDEN,)), ("ffn_gate_inp", (EXPERTS, HIDDEN)),
            ("ffn_gate_exps", (EXPERTS, EXPERT_SIZE, HIDDEN)),
            ("ffn_up_exps", (EXPERTS, EXPERT_SIZE, HIDDEN)),
            ("ffn_down_exps", (EXPERTS, HIDDEN, EXPERT_SIZE)),
        ):  # fmt: skip
            yield f"blk.{i}.{name}.weight", shape


def bf16_gguf(layers: int, cache: Path) -> Path:
    """The GGUF file, written under `cache` unless there."""
    import gguf

    path = cache / f"qwen3-30b-a3b-shape-{layers}-layers-bf16.gguf"
    if path.is_file():
        return path
    tmp = path.with_suffix(".part")
    writer = gguf.GGUFWriter(str(tmp), "qwen3moe", use_temp_file=True)
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(6144)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(TOP_K)
    writer.add_expert_feed_forward_length(EXPERT_SIZE)
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    add_default_tokenizer(writer)
    for name, shape in gguf_tensors(layers):
        values = random_tensor(name, shape)
        if len(shape) == 1:
            writer.add_tensor(name, values.numpy())
            continue
        bits = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        writer.add_tensor(name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(path)
    return path


def quantized_gguf(source: Path, qtype: str, llama_bin: Path) -> Path:
    """`source` quantized to `qtype` by llama.cpp's llama-quantize, beside it unless there."""
    path = source.with_name(source.name.replace("-bf16.gguf", f"-{qtype.lower()}.gguf"))
    if path.is_file():
        return path
    part = path.with_suffix(".part")
    done = subprocess.run([str(llama_bin / "llama-quantize"), str(source), str(part), qtype],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"llama-quantize {qtype} failed:\n{done.stderr[-3000:]}")
    part.rename(path)
    return path
