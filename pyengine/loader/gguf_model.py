"""A model from a GGUF file: its config and its weights under Hugging Face names, as the
model class of the file's architecture declares them (models/registry.py)."""

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
from pyengine.models.checkpoint_config import CommonValues, GGUFArchitecture, GGUFMetadata
from pyengine.models.registry import gguf_architecture
from pyengine.utils.lazy_weights import LazyWeights

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)(?:\.(weight|bias))?")


def config_from_gguf(g: GGUFFile) -> ModelConfig:
    """The model's config from the file's metadata, read by the model class of its
    architecture; whatever is missing or malformed there is a GGUFError naming the
    file."""
    try:
        return _config_from_gguf(g)
    except GGUFError:
        raise
    except KeyError as error:
        raise GGUFError(f"{g.path}: metadata {error} is missing") from None
    except (TypeError, ValueError, IndexError) as error:
        raise GGUFError(f"{g.path}: {error}") from None


def _architecture(g: GGUFFile) -> GGUFArchitecture:
    name = str(g.fields.get("general.architecture", ""))
    try:
        return gguf_architecture(name, GGUFMetadata(g.fields, g.tensors.keys(), name))
    except ValueError as error:
        raise GGUFError(f"{g.path}: {error}") from None


def _config_from_gguf(g: GGUFFile) -> ModelConfig:
    """What every llama.cpp architecture keeps alike (rope, special tokens) is read here;
    the rest by the model class."""
    arch = _architecture(g)
    metadata = GGUFMetadata(g.fields, g.tensors.keys(), arch.name)
    eos = g.fields.get("tokenizer.ggml.eos_token_id")
    common = CommonValues(
        architecture=arch.hf_architecture,
        rope_theta=float(metadata.field("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(g, arch.name),
        bos_token_id=g.fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )
    return arch.read_config(metadata, common)


def _rope_scaling(g: GGUFFile, arch: str) -> dict[str, Any] | None:
    """Linear and YaRN scaling from the metadata; Llama 3's, which llama.cpp keeps only as
    the tensor rope_freqs (a divisor of each rotary frequency), as those divisors."""
    kind = g.fields.get(f"{arch}.rope.scaling.type")
    if kind == "yarn":
        return _yarn_scaling(g, arch)
    if "rope_factors_long.weight" in g.tensors:
        return _longrope_scaling(g, arch)
    if kind not in (None, "none", "linear"):
        raise GGUFError(
            f"{g.path}: rope scaling {kind!r} is not supported (linear, yarn, rope_freqs)"
        )
    linear = float(g.fields.get(f"{arch}.rope.scaling.factor", 1.0)) if kind == "linear" else 1.0
    if "rope_freqs.weight" in g.tensors:
        divisors = g.tensor("rope_freqs.weight").astype(np.float64).ravel() * linear
        return {"rope_type": "freq_divisors", "divisors": divisors.tolist()}
    return {"rope_type": "linear", "factor": linear} if kind == "linear" else None


def _yarn_scaling(g: GGUFFile, arch: str) -> dict[str, Any]:
    """YaRN as Hugging Face configs say it. llama.cpp keeps DeepSeek's mscale_all_dim as
    yarn_log_multiplier (0.1 of it), and its mscale equal to it (as every DeepSeek config
    has them), so that cos and sin are unscaled and the softmax takes mscale^2."""
    key = f"{arch}.rope.scaling"
    scaling: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": float(g.fields[f"{key}.factor"]),
        "original_max_position_embeddings": int(g.fields[f"{key}.original_context_length"]),
        "beta_fast": float(g.fields.get(f"{key}.yarn_beta_fast") or 32.0),
        "beta_slow": float(g.fields.get(f"{key}.yarn_beta_slow") or 1.0),
    }
    log_multiplier = float(g.fields.get(f"{key}.yarn_log_multiplier") or 0.0)
    if log_multiplier:
        scaling["mscale"] = scaling["mscale_all_dim"] = log_multiplier / 0.1
    return scaling


def _longrope_scaling(g: GGUFFile, arch: str) -> dict[str, Any]:
    """Phi-3's LongRoPE, which llama.cpp keeps as the tensors rope_factors_long and
    rope_factors_short (a divisor of each rotary frequency, past and within the original
    context), the original context and the attention factor in the metadata."""
    original = int(g.fields[f"{arch}.rope.scaling.original_context_length"])
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": g.tensor("rope_factors_long.weight").astype(np.float64).ravel().tolist(),
        "short_factor": g.tensor("rope_factors_short.weight").astype(np.float64).ravel().tolist(),
        "original_max_position_embeddings": original,
        "factor": int(g.fields[f"{arch}.context_length"]) / original,
    }
    attention = g.fields.get(f"{arch}.rope.scaling.attn_factor")
    if attention is not None:
        scaling["attention_factor"] = float(attention)
    return scaling


def _unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores Llama's q/k rows with each head's rotary halves interleaved;
    Hugging Face's rotate_half wants them as two halves."""
    rows = w.shape[0]
    halves = w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(halves).reshape(w.shape)


def weights_from_gguf(g: GGUFFile, config: ModelConfig) -> LazyWeights:
    """Every tensor as float32, under its Hugging Face name, dequantized when read."""
    readers: dict[str, Callable[[], torch.Tensor]] = {}
    arch = _architecture(g)
    for name in g.tensors:
        hf_name, rope_heads = _hf_name(g, arch, name, config)
        if hf_name is not None:
            readers[hf_name] = functools.partial(
                _read_tensor, g, arch, name, hf_name, rope_heads, config
            )
    return LazyWeights(readers)


def _read_tensor(
    g: GGUFFile, arch: GGUFArchitecture, name: str, hf_name: str, rope_heads: int,
    config: ModelConfig,
) -> torch.Tensor:  # fmt: skip
    array = g.tensor(name)
    if rope_heads:
        array = _unpermute_rope(array, rope_heads)
    order = _row_order(arch, hf_name, config)
    if order is not None:
        array = array[order]
    if arch.to_hf is not None:
        array = arch.to_hf(hf_name, array, config)
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
    arch = _architecture(g)
    for name in g.tensors:
        hf_name, rope_heads = _hf_name(g, arch, name, config)
        if hf_name is None or not g.has_block_form(name):
            continue
        if arch.keeps_blocks is None or arch.keeps_blocks(hf_name):
            order = _row_order(arch, hf_name, config)
            readers[hf_name] = functools.partial(_read_blocks, g, name, rope_heads, order)
    return LazyBlocks(readers)


def _read_blocks(g: GGUFFile, name: str, rope_heads: int, order: Any) -> BlockQuantized:
    blocks = g.block_quantized(name)
    assert blocks is not None  # has_block_form said so
    if rope_heads:
        blocks = blocks.map_rows(functools.partial(_unpermute_rope, heads=rope_heads))
    if order is not None:
        blocks = blocks.map_rows(lambda rows: rows[order])
    return blocks


def _row_order(arch: GGUFArchitecture, hf_name: str, config: ModelConfig) -> Any:
    return None if arch.row_order is None else arch.row_order(hf_name, config)


def _hf_name(
    g: GGUFFile, arch: GGUFArchitecture, name: str, config: ModelConfig
) -> tuple[str | None, int]:
    """(GGUF tensor `name`'s Hugging Face name, or None for a tensor not loaded; the heads
    whose rows llama.cpp permuted for its rope, or 0)."""
    if name in arch.global_tensors:
        return arch.global_tensors[name], 0
    if name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
        return None, 0  # in the config's rope_scaling (_rope_scaling)
    m = _LAYER_TENSOR.fullmatch(name)
    if m is None:
        raise GGUFError(f"{g.path}: unexpected tensor {name}")
    # (a leaf of its own: "<part>.<weight|bias>", or "<part>" where the name has neither)
    leaf_key = m.group(2) if m.group(3) is None else f"{m.group(2)}.{m.group(3)}"
    if leaf_key in arch.layer_tensors:
        return f"{arch.layer_prefix}.{m.group(1)}.{arch.layer_tensors[leaf_key]}", 0
    if m.group(3) is None or m.group(2) not in arch.layer_tensors:
        raise GGUFError(f"{g.path}: unexpected tensor {name}")
    layer_name = arch.layer_tensors[m.group(2)]
    hf_name = f"{arch.layer_prefix}.{m.group(1)}.{layer_name}.{m.group(3)}"
    if not arch.rope_permuted:
        return hf_name, 0
    if m.group(2) == "attn_q":
        return hf_name, config.num_heads
    if m.group(2) == "attn_k":
        return hf_name, config.num_kv_heads
    return hf_name, 0
