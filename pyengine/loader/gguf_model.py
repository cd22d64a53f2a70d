"""A model from a GGUF file: its config, weights under Hugging Face names, tokenizer."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from pyengine.config import ModelConfig
from pyengine.layers.block_quantized import BlockQuantized
from pyengine.loader.gguf_file import GGUFError, GGUFFile
from pyengine.utils.lazy_weights import LazyWeights

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def config_from_gguf(g: GGUFFile) -> ModelConfig:
    """The model's config from the file's metadata; whatever is missing or malformed there
    is a GGUFError naming the file."""
    try:
        return _config_from_gguf(g)
    except GGUFError:
        raise
    except KeyError as error:
        raise GGUFError(f"{g.path}: metadata {error} is missing") from None
    except (TypeError, ValueError, IndexError) as error:
        raise GGUFError(f"{g.path}: {error}") from None


def _config_from_gguf(g: GGUFFile) -> ModelConfig:
    arch = str(g.fields.get("general.architecture", ""))
    if arch not in _ARCHITECTURES:
        raise GGUFError(
            f"{g.path}: GGUF architecture {arch!r} is not supported ({', '.join(_ARCHITECTURES)})"
        )

    def field(key: str, default: Any = None) -> Any:
        value = g.fields.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{g.path}: metadata {arch}.{key} is missing")
        return value

    heads = int(field("attention.head_count"))
    hidden = int(field("embedding_length"))
    eos = g.fields.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=_ARCHITECTURES[arch],
        vocab_size=int(g.fields.get(f"{arch}.vocab_size", len(g.fields["tokenizer.ggml.tokens"]))),
        hidden_size=hidden,
        intermediate_size=int(field("feed_forward_length")),
        num_layers=int(field("block_count")),
        num_heads=heads,
        num_kv_heads=int(field("attention.head_count_kv", heads)),
        head_size=int(field("attention.key_length", hidden // heads)),
        max_position_embeddings=int(field("context_length", 2048)),
        norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(g, arch),
        tie_word_embeddings="output.weight" not in g.tensors,
        attention_bias="blk.0.attn_q.bias" in g.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in g.tensors,
        sliding_window=int(g.fields.get(f"{arch}.attention.sliding_window", 0) or 0),
        bos_token_id=g.fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _rope_scaling(g: GGUFFile, arch: str) -> dict[str, Any] | None:
    """Linear scaling from the metadata; Llama 3's, which llama.cpp keeps only as the
    tensor rope_freqs (a divisor of each rotary frequency), as those divisors."""
    kind = g.fields.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none", "linear"):
        raise GGUFError(f"{g.path}: rope scaling {kind!r} is not supported (linear, rope_freqs)")
    linear = float(g.fields.get(f"{arch}.rope.scaling.factor", 1.0)) if kind == "linear" else 1.0
    if "rope_freqs.weight" in g.tensors:
        divisors = g.tensor("rope_freqs.weight").astype(np.float64).ravel() * linear
        return {"rope_type": "freq_divisors", "divisors": divisors.tolist()}
    return {"rope_type": "linear", "factor": linear} if kind == "linear" else None


def _unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores Llama's q/k rows with each head's rotary halves interleaved;
    Hugging Face's rotate_half wants them as two halves."""
    rows = w.shape[0]
    halves = w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(halves).reshape(w.shape)


def weights_from_gguf(g: GGUFFile, config: ModelConfig) -> LazyWeights:
    """Every tensor as float32, under its Hugging Face name, dequantized when read."""
    readers: dict[str, Callable[[], torch.Tensor]] = {}
    for name in g.tensors:
        hf_name, rope_heads = _hf_name(g, name, config)
        if hf_name is not None:
            readers[hf_name] = functools.partial(_read_tensor, g, name, rope_heads)
    return LazyWeights(readers)


def _read_tensor(g: GGUFFile, name: str, rope_heads: int) -> torch.Tensor:
    array = g.tensor(name)
    if rope_heads:
        array = _unpermute_rope(array, rope_heads)
    return torch.from_numpy(np.ascontiguousarray(array))


class LazyBlocks(Mapping[str, BlockQuantized]):
    """Block forms by name, each decoded from the file when asked for (once a layer takes
    it), so that no more than one tensor's unpacked integers exist at a time."""

    def __init__(self, readers: dict[str, Callable[[], BlockQuantized]]) -> None:
        self._readers = readers

    def __getitem__(self, name: str) -> BlockQuantized:
        return self._readers[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)


def block_quantized_from_gguf(g: GGUFFile, config: ModelConfig) -> LazyBlocks:
    """The Q4_0/Q4_1/Q8_0 matrices in their block form, under their Hugging Face names (the
    same values as weights_from_gguf's, bit for bit)."""
    readers: dict[str, Callable[[], BlockQuantized]] = {}
    for name in g.tensors:
        hf_name, rope_heads = _hf_name(g, name, config)
        if hf_name is not None and g.has_block_form(name):
            readers[hf_name] = functools.partial(_read_blocks, g, name, rope_heads)
    return LazyBlocks(readers)


def _read_blocks(g: GGUFFile, name: str, rope_heads: int) -> BlockQuantized:
    blocks = g.block_quantized(name)
    assert blocks is not None  # has_block_form said so
    if rope_heads:
        blocks = blocks.map_rows(functools.partial(_unpermute_rope, heads=rope_heads))
    return blocks


def _hf_name(g: GGUFFile, name: str, config: ModelConfig) -> tuple[str | None, int]:
    """(GGUF tensor `name`'s Hugging Face name, or None for a tensor not loaded; the heads
    whose rows llama.cpp permuted for its rope, or 0)."""
    m = _LAYER_TENSOR.fullmatch(name)
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name], 0
    if name == "rope_freqs.weight":
        return None, 0  # in the config's rope_scaling (_rope_scaling)
    if not (m and m.group(2) in _LAYER_NAMES):
        raise GGUFError(f"{g.path}: unexpected tensor {name}")
    hf_name = f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    if g.fields.get("general.architecture") not in ("llama", "mistral"):
        return hf_name, 0
    if m.group(2) == "attn_q":
        return hf_name, config.num_heads
    if m.group(2) == "attn_k":
        return hf_name, config.num_kv_heads
    return hf_name, 0
