"""Hugging Face folders of the default model for the benchmarks, made once from its GGUF
file: its float32 weights (the Q4_1 file dequantized), and the same weights quantized to
compressed-tensors' int-quantized W8A8 (int8 per output channel, symmetric; activations
per token at run time), and to its float-quantized FP8 (e4m3 per output channel; e4m3
activations per token at run time). Each folder has the config.json and tokenizer.json
pyengine reads.
"""

from __future__ import annotations

import json
from pathlib import Path

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


QUANTIZED_FORMS = {
    "w8a8": (int8_channels, w8a8_scheme("int")),
    "fp8": (fp8_channels, w8a8_scheme("float")),
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
    """{"float32": folder, "w8a8": folder, "fp8": folder}, written under `cache` unless
    there already."""
    folders = {form: cache / f"smollm2-{form}" for form in ("float32", *QUANTIZED_FORMS)}
    if all((f / "model.safetensors").is_file() for f in folders.values()):
        return folders
    loaded = load_model(DEFAULT_MODEL, keep_block_quantized=False)
    assert loaded.weights is not None and loaded.tokenizer is not None
    weights = {name: loaded.weights[name].float().contiguous() for name in loaded.weights}
    config = hf_config(loaded.config)
    for form, folder in folders.items():
        tensors, scheme = dict(weights), {}
        if form in QUANTIZED_FORMS:
            quantize, quantization_config = QUANTIZED_FORMS[form]
            scheme = {"quantization_config": quantization_config}
            for name, w in weights.items():
                module, _, kind = name.rpartition(".")
                if kind == "weight" and module.rpartition(".")[2] in LINEAR:
                    tensors[name], tensors[f"{module}.weight_scale"] = quantize(w)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, **scheme}))
        loaded.tokenizer.tokenizer.save(str(folder / "tokenizer.json"))
    return folders
