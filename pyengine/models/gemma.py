"""Gemma 2 and Gemma 3 (text) on the Llama family's layers, with what Gemma does
otherwise:

- RMSNorms that scale by (1 + w): the checkpoint's w is loaded as 1 + w, so that the
  fused norm kernels run unchanged;
- the embeddings scaled by sqrt(hidden_size);
- four norms a layer: before and after the attention, before and after the MLP;
- GeGLU: gelu(gate, tanh approximation) * up;
- attention scaled by query_pre_attn_scalar^-0.5, its scores soft-capped (cap *
  tanh(score / cap)), sliding-window layers beside global ones (`layer_types`);
- the final logits soft-capped (Gemma 2);
- per-head q/k RMSNorms (1 + w) and a rotary base of their own for the sliding layers
  (Gemma 3: `rope_parameters` per layer type, or `rope_local_base_freq`).

From GGUF files too (llama.cpp's gemma2 and gemma3): llama.cpp stores the norms as
1 + w, which the loader takes back to w.

The sliding layers are KV-cache groups of their own (worker/kv_layout.py), whose blocks
past the window are released. On the CPU the GeGLU and the embeddings' scale are
kernels, so that decode steps record.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pyengine import ops
from pyengine.config import ModelConfig
from pyengine.layers.attention import AttentionMetadata, KVCache
from pyengine.layers.layernorm import RMSNorm
from pyengine.layers.linear import LayerContext
from pyengine.layers.rotary import RotaryEmbedding
from pyengine.models.checkpoint_config import (
    CommonValues,
    GGUFArchitecture,
    GGUFMetadata,
    integer,
)
from pyengine.models.llama import (
    _GGUF_GLOBAL_TENSORS,
    MLP,
    Attention,
    DecoderLayer,
    LlamaFamilyConfig,
    LlamaForCausalLM,
    _config_from_gguf,
    _config_from_hf,
    _Variant,
)
from pyengine.models.llama import _GGUF_LAYER_TENSORS as _LLAMA_GGUF_LAYER_TENSORS
from pyengine.models.weights import WeightRouter

# The dtypes the CPU kernels take.
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class GemmaFamilyConfig(LlamaFamilyConfig):
    """Gemma's switches beside the Llama family's."""

    query_scale: float = 0.0  # q . k times this (query_pre_attn_scalar^-0.5)
    attention_soft_cap: float = 0.0  # attn_logit_softcapping (0: none)
    final_soft_cap: float = 0.0  # final_logit_softcapping (0: none)
    # The sliding layers' rotary base and scaling where they have their own (0: the
    # model's rope_theta and rope_scaling, which the global layers take).
    local_rope_theta: float = 0.0
    local_rope_scaling: dict[str, Any] | None = None


def layer_types(raw: Mapping[str, Any], num_layers: int) -> list[str]:
    """`layer_types`, or the default of Gemma 2 and gpt-oss where a config has none:
    sliding, then full, alternating from the first layer."""
    types = raw.get("layer_types")
    if types is None:
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ValueError(f"layer_types must name each of the {num_layers} layers, got {types!r}")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} are not supported (sliding, full)")
    return types


def _rope(parameters: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of one rope_parameters entry (a "default" one scales nothing)."""
    kind = parameters.get("rope_type", parameters.get("type"))
    scaling = None if kind in (None, "default") else dict(parameters)
    return float(parameters.get("rope_theta", 10000.0)), scaling


def _layer_ropes(
    raw: Mapping[str, Any], common: CommonValues
) -> tuple[CommonValues, float, dict[str, Any] | None]:
    """The global layers' rope (in `common`) and the sliding layers' own theta and scaling
    (0.0, None: the same): transformers 5's rope_parameters per layer type, or Gemma 3's
    older rope_theta, rope_scaling and rope_local_base_freq."""
    parameters = raw.get("rope_parameters")
    if isinstance(parameters, dict) and "full_attention" in parameters:
        theta, scaling = _rope(parameters["full_attention"])
        local_theta, local_scaling = _rope(parameters.get("sliding_attention") or {})
        return replace(common, rope_theta=theta, rope_scaling=scaling), local_theta, local_scaling
    return common, float(raw.get("rope_local_base_freq") or 0.0), None


def _gemma_config_from_hf(raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
    common, local_theta, local_scaling = _layer_ropes(raw, common)
    gemma3 = common.architecture == "Gemma3ForCausalLM"
    config = _config_from_hf(raw, common, _Variant(qk_norm=gemma3))
    activation = raw.get("hidden_activation") or raw.get("hidden_act")
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma's hidden_activation {activation!r} is not supported")
    types = layer_types(raw, config.num_layers)
    window = integer(raw.get("sliding_window") or 0)
    sliding = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    if sliding and window < 1:
        raise ValueError("sliding layers need a sliding_window")
    family = GemmaFamilyConfig(
        attention_bias=bool(raw.get("attention_bias", False)),
        qk_norm=gemma3,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        query_scale=float(raw.get("query_pre_attn_scalar", config.head_size)) ** -0.5,
        attention_soft_cap=float(raw.get("attn_logit_softcapping") or 0.0),
        final_soft_cap=float(raw.get("final_logit_softcapping") or 0.0),
        window=window,
        sliding_layers=sliding,
    )
    return replace(config, tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
                   family=family)  # fmt: skip


# llama.cpp's Gemma tensors (norms before and after the attention and the MLP, q/k norms
# in Gemma 3) and the family's.
_GGUF_LAYER_TENSORS = {
    **_LLAMA_GGUF_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Their 27B models scale q . k by (hidden / heads)^-0.5, not the head size's, and are
# known to llama.cpp by their layer count alone (it keeps no query_pre_attn_scalar).
_GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Layers a period of the sliding pattern, the last of each full (llama.cpp's defaults).
_GGUF_SLIDING_PERIOD = {"gemma2": 2, "gemma3": 6}


def _gguf_sliding_layers(m: GGUFMetadata, layers: int) -> tuple[int, ...]:
    """The sliding layers: `attention.sliding_window_pattern` where the file has it (a
    period, or a flag a layer), else llama.cpp's default period."""
    pattern = m.fields.get(f"{m.architecture}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"sliding_window_pattern must flag each of the {layers} layers")
        return tuple(i for i, flag in enumerate(pattern) if flag)
    period = integer(pattern) if pattern is not None else _GGUF_SLIDING_PERIOD[m.architecture]
    return tuple(i for i in range(layers) if i % period != period - 1)


def _gemma_config_from_gguf(m: GGUFMetadata, common: CommonValues) -> ModelConfig:
    """llama.cpp's keys and defaults: Gemma 2's layers alternate sliding and full from the
    first, Gemma 3's are five sliding to one full, its sliding ones turning by a base of
    their own (`rope.freq_base_swa`, 10000) unscaled; soft-caps where the file has them."""
    gemma3 = m.architecture == "gemma3"
    config = _config_from_gguf(m, common)
    window = integer(m.field("attention.sliding_window", 0))
    sliding = _gguf_sliding_layers(m, config.num_layers) if window else ()
    if config.num_layers == _GGUF_27B_LAYERS[m.architecture]:
        query_scale = (config.hidden_size / config.num_heads) ** -0.5
    else:
        query_scale = config.head_size**-0.5
    family = GemmaFamilyConfig(
        qk_norm=gemma3,
        local_rope_theta=float(m.field("rope.freq_base_swa", 10000.0)) if gemma3 else 0.0,
        query_scale=query_scale,
        attention_soft_cap=float(m.field("attn_logit_softcapping", 0.0)),
        final_soft_cap=float(m.field("final_logit_softcapping", 0.0)),
        window=window,
        sliding_layers=sliding,
    )
    return replace(config, sliding_window=0, family=family)


def _norms_to_hf(name: str, values: Any, config: ModelConfig) -> Any:
    """llama.cpp stores Gemma's norms as 1 + w; the checkpoint's w back."""
    return values - 1 if name.endswith("norm.weight") else values


_GGUF_ARCHITECTURES = tuple(
    GGUFArchitecture(
        name,
        hf,
        _gemma_config_from_gguf,
        _GGUF_GLOBAL_TENSORS,
        _GGUF_LAYER_TENSORS,
        "model.layers",
        to_hf=_norms_to_hf,
    )  # fmt: skip
    for name, hf in (("gemma2", "Gemma2ForCausalLM"), ("gemma3", "Gemma3ForCausalLM"))
)


class GemmaMLP(MLP):
    """gelu(gate) * up (the tanh approximation): the [gate; up] product whole, then the
    CPU's kernel (or torch elsewhere)."""

    fuses_silu = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = self.gate_up_proj(x)
        if product.is_cpu and product.dtype in _KERNEL_DTYPES:  # (a recorded step holds it)
            h = torch.empty(x.shape[0], product.shape[1] // 2, dtype=product.dtype)
            ops.gelu_tanh_and_mul(h, product)
        else:
            gate, up = product.chunk(2, dim=-1)
            h = F.gelu(gate, approximate="tanh") * up
        out: torch.Tensor = self.down_proj(h)
        return out


class GemmaDecoderLayer(DecoderLayer):
    norms: ClassVar[tuple[str, ...]] = (
        "input_layernorm", "post_attention_layernorm",
        "pre_feedforward_layernorm", "post_feedforward_layernorm",
    )  # fmt: skip

    def __init__(
        self, c: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, index: int
    ) -> None:
        nn.Module.__init__(self)
        family = c.family_config(GemmaFamilyConfig)
        prefix = f"model.layers.{index}"
        window = family.layer_window(index)
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.post_feedforward_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.self_attn = Attention(
            c, rotary, ctx, f"{prefix}.self_attn", sliding_window=window,
            scale=family.query_scale, logit_soft_cap=family.attention_soft_cap,
        )  # fmt: skip
        self.mlp = GemmaMLP(c, ctx, f"{prefix}.mlp")

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added)."""
        h, residual = self.enter(h, residual)
        h = self.post_attention_layernorm(self.self_attn(h, positions, cache, meta))
        self.pre_feedforward_layernorm.add_residual(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    hf_architectures: ClassVar[tuple[str, ...]] = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
    gguf_architectures: ClassVar[tuple[GGUFArchitecture, ...]] = _GGUF_ARCHITECTURES

    @classmethod
    def config_from_hf(cls, raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
        return _gemma_config_from_hf(raw, common)

    def make_layer(
        self, config: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, index: int
    ) -> nn.Module:
        family = config.family_config(GemmaFamilyConfig)
        if family.local_rope_theta and index in family.sliding_layers:
            rotary = self.local_rotary(config, rotary)
        return GemmaDecoderLayer(config, rotary, ctx, index)

    def local_rotary(self, config: ModelConfig, rotary: RotaryEmbedding) -> RotaryEmbedding:
        """The sliding layers' rotary embedding (made once, as long as the model's)."""
        local: RotaryEmbedding | None = self.__dict__.get("_local_rotary")
        if local is None:
            family = config.family_config(GemmaFamilyConfig)
            cache = rotary.cos_sin_cache
            local = RotaryEmbedding(config.head_size, cache.shape[0], family.local_rope_theta,
                                    family.local_rope_scaling, cache.device)  # fmt: skip
            self.__dict__["_local_rotary"] = local
        return local

    def route_norm(self, router: WeightRouter, name: str, norm: RMSNorm) -> None:
        """Gemma's norms scale by (1 + w): the weight is loaded as that."""
        router.plus_one(name, norm.weight)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = super().embed(input_ids)
        # (sqrt(hidden) rounded to the model's dtype first, as Gemma multiplies by it)
        scale = torch.tensor(math.sqrt(self.config.hidden_size), dtype=h.dtype)
        if not (h.is_cpu and h.dtype in _KERNEL_DTYPES):
            return h * scale
        out = torch.empty_like(h)
        ops.scale(out, h, float(scale))  # (a kernel: a recorded decode step holds it)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.family_config(GemmaFamilyConfig).final_soft_cap
        return torch.tanh(logits / cap) * cap if cap else logits
