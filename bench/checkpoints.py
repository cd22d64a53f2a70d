"""Hugging Face folders of the default model for the benchmarks, made once from its GGUF
file: its float32 weights (the Q4_1 file dequantized), and the same weights quantized to
compressed-tensors' int-quantized W8A8 (int8 per output channel, symmetric; activations
per token at run time), to its float-quantized FP8 (e4m3 per output channel; e4m3
activations per token at run time), and to GPTQ's and AWQ's 4-bit formats (groups of
64, rounded to nearest: their layouts, not their searches). Each folder has the
config.json and tokenizer.json pyengine reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from pyengine.config import ModelConfig
from pyengine.loader.resolve import DEFAULT_MODEL, load_model

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def w8a8_scheme(value_type: str) -> dict[str, object]:
    """compressed-tensors' 8-bit weights per channel and activations per token (dynamic):
    value_type "int" (int-quantized W8A8) or "float" (float-quantized FP8)."""
    eight_bits = {"num_bits": 8, "type": value_type, "symmetric": True}
    return {
        "quant_method": "compressed-tensors", "ignore": ["lm_head"],
        "format": "int-quantized" if value_type == "int" else "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**eight_bits, "strategy": "channel"},
            "input_activations": {**eight_bits, "strategy": "token", "dynamic": True},
        }},
    }  # fmt: skip


def int8_channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8, scale [out, 1]): w ~ q * scale, scale = max|w| / 127 per output channel."""
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-12)
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale


def fp8_channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3, scale [out, 1]): w ~ q * scale, scale = max|w| / 448 per output channel."""
    scale = (w.abs().amax(dim=1, keepdim=True) / 448).clamp_min(1e-12)
    return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def int4_groups(w: torch.Tensor, group: int = 64) -> tuple[torch.Tensor, ...]:
    """Round-to-nearest 4-bit, asymmetric, per `group` inputs (not GPTQ's or AWQ's own
    search; their formats only): (q [out, in] 0..15, scale [out, groups] float16 values,
    zero [out, groups] 1..15: GPTQ's stored zero less 1 must not wrap) with w ~ scale *
    (q - zero)."""
    out, inputs = w.shape
    grouped = w.reshape(out, inputs // group, group)
    low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    scale = ((high - low) / 14).clamp_min(1e-8).half().float()
    zero = torch.round(-low / scale).clamp(1, 15)
    q = torch.round(grouped / scale[..., None] + zero[..., None]).clamp(0, 15)
    return q.reshape(out, inputs).long(), scale, zero.long()


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of each nibble of AutoAWQ's int32


def pack_int32(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """values [rows, 8 m] (0..15) as int32 [rows, m]: nibble k of a word holds column
    order[k] of its 8."""
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for k, column in enumerate(order):
        words |= (values[:, column::8] & 15) << (4 * k)
    return torch.from_numpy((words.numpy() & 0xFFFFFFFF).astype(np.uint32).view(np.int32))


def gptq_tensors(w: torch.Tensor, module: str) -> dict[str, torch.Tensor]:
    """AutoGPTQ's format: qweight [in / 8, out] packed along the input, qzeros [groups,
    out / 8] (zeros less 1) along the output, scales [groups, out], g_idx [in]."""
    q, scale, zero = int4_groups(w)
    return {
        f"{module}.qweight": pack_int32(q).t().contiguous(),
        f"{module}.qzeros": pack_int32((zero - 1).t().contiguous()),
        f"{module}.scales": scale.t().contiguous().half(),
        f"{module}.g_idx": (torch.arange(w.shape[1]) // 64).int(),
    }


def awq_tensors(w: torch.Tensor, module: str) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM format: qweight [in, out / 8] and qzeros [groups, out / 8] packed
    along the output in AWQ_ORDER, scales [groups, out]."""
    q, scale, zero = int4_groups(w)
    return {
        f"{module}.qweight": pack_int32(q.t().contiguous(), AWQ_ORDER),
        f"{module}.qzeros": pack_int32(zero.t().contiguous(), AWQ_ORDER),
        f"{module}.scales": scale.t().contiguous().half(),
    }


GPTQ_SCHEME = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False,
               "sym": False, "checkpoint_format": "gptq"}  # fmt: skip
AWQ_SCHEME = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
              "version": "gemm"}  # fmt: skip


def channel_tensors(
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> Callable[[torch.Tensor, str], dict[str, torch.Tensor]]:
    """compressed-tensors' 8-bit forms: `weight` and its `weight_scale`."""

    def tensors(w: torch.Tensor, module: str) -> dict[str, torch.Tensor]:
        q, scale = quantize(w)
        return {f"{module}.weight": q, f"{module}.weight_scale": scale}

    return tensors


# Each quantized folder: the tensors that replace a linear layer's weight, and the
# config's quantization_config.
QUANTIZED_FORMS = {
    "w8a8": (channel_tensors(int8_channels), w8a8_scheme("int")),
    "fp8": (channel_tensors(fp8_channels), w8a8_scheme("float")),
    "gptq": (gptq_tensors, GPTQ_SCHEME),
    "awq": (awq_tensors, AWQ_SCHEME),
}


def hf_config(c: ModelConfig) -> dict[str, object]:
    return {
        "architectures": [c.architecture], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_size, "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids),
    }  # fmt: skip


def default_model_folders(cache: Path) -> dict[str, Path]:
    """{"float32": folder, and one for each of QUANTIZED_FORMS}, each written under
    `cache` unless there already."""
    folders = {form: cache / f"smollm2-{form}" for form in ("float32", *QUANTIZED_FORMS)}
    missing = {f: p for f, p in folders.items() if not (p / "model.safetensors").is_file()}
    if not missing:
        return folders
    loaded = load_model(DEFAULT_MODEL, keep_block_quantized=False)
    assert loaded.weights is not None and loaded.tokenizer is not None
    weights = {name: loaded.weights[name].float().contiguous() for name in loaded.weights}
    config = hf_config(loaded.config)
    for form, folder in missing.items():
        tensors, scheme = dict(weights), {}
        if form in QUANTIZED_FORMS:
            quantized_tensors, quantization_config = QUANTIZED_FORMS[form]
            scheme = {"quantization_config": quantization_config}
            for name, w in weights.items():
                module, _, kind = name.rpartition(".")
                if kind == "weight" and module.rpartition(".")[2] in LINEAR:
                    del tensors[name]
                    tensors.update(quantized_tensors(w, module))
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, **scheme}))
        loaded.tokenizer.tokenizer.save(str(folder / "tokenizer.json"))
    return folders
