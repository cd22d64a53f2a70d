"""Checkpoints of Llama-3.2-1B's and Llama-3.2-3B's shapes (with SmolLM2's vocabulary and
tokenizer) for the benchmarks that compare quantized forms across engines: random
weights, drawn tensor by tensor from a seeded generator, written once as

- a GGUF file in float16 with the default model's tokenizer (llama.cpp reads it too),
  and from it, by llama.cpp's `llama-quantize`, Q4_1 and Q8_0 files: the same weights
  in the blocks both engines read;
- a compressed-tensors W8A8 folder (int8 per output channel, int8 activations per token
  at run time: bench/checkpoints.py's quantizer), which pyengine and vLLM's CPU build read.

Random weights make the times of a trained model (every step runs every layer in full);
their tokens mean nothing (the GGUF files hold q and k in Hugging Face's row order, not
llama.cpp's rotary one, so they are not the W8A8 folder's function: the same shapes and
bytes, not the same model). Each file is written under the cache folder unless there.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from pyengine.loader.resolve import default_model_path

from .checkpoints import LINEAR, QUANTIZED_FORMS, w8a8_scheme

# Llama-3.2's shapes with SmolLM2's vocabulary (49152).
SHAPES = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64},
    "3b": {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
           "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128},
}  # fmt: skip
VOCAB = 49152

# Each GGUF file type `llama-quantize` is asked for, by the name the benchmarks use.
GGUF_TYPES = {"q4_1": "Q4_1", "q8_0": "Q8_0"}


def hf_config(name: str) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16", **SHAPES[name],
    }  # fmt: skip


def shape_folder(name: str, tokenizer_folder: Path, cache: Path) -> Path:
    """A config.json of the `name` shape and the default model's tokenizer: what the
    engines' dummy loaders (random weights at load) read."""
    folder = cache / f"llama-3.2-{name}-shape"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(name)))
    shutil.copy(tokenizer_folder / "tokenizer.json", folder / "tokenizer.json")
    return folder


def hf_shapes(name: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(Hugging Face name, shape) of every tensor of the `name` shape, tied head."""
    c = SHAPES[name]
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    yield "model.embed_tokens.weight", (VOCAB, hidden)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (hidden,)
        yield p + "self_attn.q_proj.weight", (q, hidden)
        yield p + "self_attn.k_proj.weight", (kv, hidden)
        yield p + "self_attn.v_proj.weight", (kv, hidden)
        yield p + "self_attn.o_proj.weight", (hidden, q)
        yield p + "post_attention_layernorm.weight", (hidden,)
        yield p + "mlp.gate_proj.weight", (inter, hidden)
        yield p + "mlp.up_proj.weight", (inter, hidden)
        yield p + "mlp.down_proj.weight", (hidden, inter)
    yield "model.norm.weight", (hidden,)


def random_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The same float32 values for `name` every time: norms near 1, matrices N(0, 0.02)."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    values = torch.randn(shape, generator=generator)
    return 1 + 0.1 * values if len(shape) == 1 else 0.02 * values


GGUF_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def add_default_tokenizer(writer: Any) -> None:
    """The default model's tokenizer and chat template, from its GGUF file's metadata,
    into a gguf.GGUFWriter's."""
    import gguf

    reader = gguf.GGUFReader(str(default_model_path()))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)


def write_float16_gguf(name: str, path: Path) -> None:
    """The `name` shape's random weights as a llama GGUF in float16 (norms float32), with
    the default model's tokenizer and chat template."""
    import gguf

    c = SHAPES[name]
    tmp = path.with_suffix(".part")
    # (use_temp_file: the tensors wait in a temporary file, not in memory, until written)
    writer = gguf.GGUFWriter(str(tmp), "llama", use_temp_file=True)
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(4096)
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_key_length(c["head_dim"])
    writer.add_value_length(c["head_dim"])
    writer.add_rope_dimension_count(c["head_dim"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    add_default_tokenizer(writer)
    for hf, shape in hf_shapes(name):
        values = random_tensor(hf, shape).numpy()
        writer.add_tensor(gguf_name(hf), values if len(shape) == 1 else values.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(path)


def gguf_files(name: str, cache: Path, llama_bin: Path) -> dict[str, Path]:
    """{"q4_1": path, "q8_0": path}: the `name` shape's weights in those GGUF types."""
    folder = cache / f"llama-3.2-{name}-gguf"
    folder.mkdir(parents=True, exist_ok=True)
    files = {form: folder / f"{form}.gguf" for form in GGUF_TYPES}
    missing = [form for form, path in files.items() if not path.is_file()]
    if not missing:
        return files
    float16 = folder / "f16.gguf"
    try:
        if not float16.is_file():
            write_float16_gguf(name, float16)
        for form in missing:
            part = files[form].with_suffix(".part")
            done = subprocess.run([str(llama_bin / "llama-quantize"), str(float16), str(part),
                                   GGUF_TYPES[form]], capture_output=True, text=True)  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"llama-quantize {GGUF_TYPES[form]} failed:\n"
                                   f"{done.stderr[-3000:]}")  # fmt: skip
            part.rename(files[form])
    finally:  # (the quantized files are what the benchmarks read; no part left behind)
        for leftover in (float16, *folder.glob("*.part")):
            leftover.unlink(missing_ok=True)
    return files


def w8a8_folder(name: str, tokenizer_folder: Path, cache: Path) -> Path:
    """The `name` shape's weights as compressed-tensors W8A8 (int8 per channel)."""
    folder = cache / f"llama-3.2-{name}-w8a8"
    if (folder / "model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    quantized_tensors, _ = QUANTIZED_FORMS["w8a8"]
    tensors: dict[str, torch.Tensor] = {}
    for hf, shape in hf_shapes(name):
        values = random_tensor(hf, shape)
        module, _, _ = hf.rpartition(".")
        if module.rpartition(".")[2] in LINEAR:
            tensors.update(quantized_tensors(values, module))
        else:
            tensors[hf] = values.to(torch.bfloat16)
    part = folder / "model.safetensors.part"
    save_file(tensors, str(part), metadata={"format": "pt"})
    config = {**hf_config(name), "quantization_config": w8a8_scheme("int")}
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(tokenizer_folder / "tokenizer.json", folder / "tokenizer.json")
    part.rename(folder / "model.safetensors")
    return folder
