"""Falcon-H1 (FalconH1ForCausalLM): every layer runs attention and a Mamba-2 mixer side
by side on the same normed input, sums them into the residual stream, then an MLP. Each
layer so has a KV cache and a recurrent state both (`FamilyConfig.keeps_state`).

Falcon-H1's multipliers (muP) are constants, folded into the weights as they load
(`WeightRouter.scale`): attention_in_multiplier into q, k and v, key_multiplier into k,
attention_out_multiplier into o_proj, ssm_in_multiplier and the five ssm_multipliers
(the gate, x, B, C and the step: the projection's sections) into the mixer's in_proj,
ssm_out_multiplier into its out_proj, and the MLP's gate and down multipliers into
gate_proj and down_proj; the embeddings and the logits are scaled as they run. The
mixer's gated RMSNorm is optional (mamba_rms_norm) and normalises before or after the
gate (mamba_norm_before_gate); its inner size may be set apart (mamba_d_ssm)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from pyengine.config import ModelConfig
from pyengine.layers.attention import AttentionMetadata, KVCache
from pyengine.layers.layernorm import RMSNorm
from pyengine.layers.linear import LayerContext
from pyengine.layers.rotary import RotaryEmbedding
from pyengine.models.checkpoint_config import (
    CommonValues,
    GGUFArchitecture,
    GGUFMetadata,
    hf_values_from_gguf,
    integer,
)
from pyengine.models.llama import (
    _GGUF_LAYER_TENSORS,
    MLP,
    Attention,
    DecoderLayer,
    LlamaFamilyConfig,
    LlamaForCausalLM,
    _config_from_hf,
    _Variant,
)
from pyengine.models.mamba2 import (
    HYBRID_KEYS,
    Mamba2Layer,
    MambaSizes,
    check_mamba_split,
    gguf_mamba_sizes,
    gguf_mamba_tensors,
    mamba_sizes,
    mamba_values_to_hf,
)
from pyengine.models.weights import WeightRouter


@dataclass(frozen=True)
class FalconH1FamilyConfig(LlamaFamilyConfig):
    mamba: MambaSizes = MambaSizes()
    mamba_norm: str = "none"  # Mamba2Shape.norm
    multipliers: tuple[tuple[str, float], ...] = ()  # config.json's, by name
    ssm_multipliers: tuple[float, ...] = (1.0,) * 5
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)

    def keeps_state(self, index: int) -> bool:
        return True  # (every layer has its mixer beside its attention)

    def check_split(self, tensor_parallel_size: int, expert_parallel: bool) -> None:
        check_mamba_split(self.mamba, tensor_parallel_size)

    def multiplier(self, name: str) -> float:
        return dict(self.multipliers).get(name, 1.0)


_MULTIPLIERS = ("attention_in_multiplier", "attention_out_multiplier", "key_multiplier",
                "ssm_in_multiplier", "ssm_out_multiplier", "embedding_multiplier",
                "lm_head_multiplier")  # fmt: skip


def _config_from_falcon(raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias: Falcon-H1 MLPs with biases are not supported")
    config = _config_from_hf(raw, common, _Variant())
    hidden = config.hidden_size
    inner = raw.get("mamba_d_ssm") or int(float(raw.get("mamba_expand", 2)) * hidden)
    sizes = replace(
        mamba_sizes(raw, integer(inner), HYBRID_KEYS),
        out_bias=bool(raw.get("projectors_bias", False)),
    )
    norm = "none"
    if raw.get("mamba_rms_norm", False):
        norm = "before_gate" if raw.get("mamba_norm_before_gate", True) else "after_gate"
    ssm = tuple(float(m) for m in raw.get("ssm_multipliers") or (1.0,) * 5)
    mlp = tuple(float(m) for m in raw.get("mlp_multipliers") or (1.0, 1.0))
    if len(ssm) != 5 or len(mlp) != 2:
        raise ValueError(
            f"ssm_multipliers must hold 5 numbers and mlp_multipliers 2, got {ssm} and {mlp}"
        )
    family = FalconH1FamilyConfig(
        **asdict(config.family), mamba=sizes, mamba_norm=norm,
        multipliers=tuple((n, float(raw.get(n) or 1.0)) for n in _MULTIPLIERS),
        ssm_multipliers=ssm, mlp_multipliers=(mlp[0], mlp[1]),
    )  # fmt: skip
    return replace(config, family=family)


def _config_from_gguf(m: GGUFMetadata, common: CommonValues) -> ModelConfig:
    """llama.cpp's falcon-h1 keys as the config.json they came from says them. Its
    conversion folds every multiplier into the weights (so here each is 1), and
    llama.cpp's Mamba-2 layer gates before its norm, where the file has one."""
    names = m.tensor_names
    raw = {
        **hf_values_from_gguf(m), **gguf_mamba_sizes(m, 0, HYBRID_KEYS),
        "head_dim": integer(m.field("attention.key_length")),
        "intermediate_size": integer(m.field("feed_forward_length")),
        "mamba_d_ssm": integer(m.field("ssm.inner_size")),
        "projectors_bias": "blk.0.ssm_out.bias" in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mamba_rms_norm": "blk.0.ssm_norm.weight" in names,
        "mamba_norm_before_gate": False,
    }  # fmt: skip
    return _config_from_falcon(raw, common)


_GGUF_ARCHITECTURES = (
    GGUFArchitecture(
        "falcon-h1", "FalconH1ForCausalLM", _config_from_gguf,
        {"token_embd.weight": "model.embed_tokens.weight",
         "output_norm.weight": "model.final_layernorm.weight", "output.weight": "lm_head.weight"},
        {**{part: name for part, name in _GGUF_LAYER_TENSORS.items() if part.startswith("attn_")},
         **{f"ffn_{part}": f"feed_forward.{part}_proj" for part in ("gate", "up", "down")},
         "ffn_norm": "pre_ff_layernorm.weight",  # (without a suffix in the file)
         **gguf_mamba_tensors("mamba")},
        "model.layers", to_hf=mamba_values_to_hf,
    ),
)  # fmt: skip


class FalconH1Layer(DecoderLayer):
    """Attention and a Mamba-2 mixer on the same normed input, summed; then the MLP (its
    multipliers in its weights)."""

    norms: ClassVar[tuple[str, ...]] = ("input_layernorm", "pre_ff_layernorm")

    def __init__(
        self, c: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, prefix: str
    ) -> None:
        nn.Module.__init__(self)
        family = c.family_config(FalconH1FamilyConfig)
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.self_attn = Attention(c, rotary, ctx, f"{prefix}.self_attn",
                                   output_bias=family.attention_bias)  # fmt: skip
        self.mamba = Mamba2Layer(c.hidden_size, family.mamba, c.norm_eps, ctx, f"{prefix}.mamba",
                                 family.mamba_norm)  # fmt: skip
        self.pre_ff_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.mlp = MLP(c, ctx, f"{prefix}.feed_forward")

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
        cache: KVCache, meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        h, residual = self.enter(h, residual)
        mixed = self.mamba(h, positions, cache, meta) + self.self_attn(h, positions, cache, meta)
        self.pre_ff_layernorm.add_residual(mixed, residual)
        return self.mlp(mixed), residual


class FalconH1ForCausalLM(LlamaForCausalLM):
    hf_architectures: ClassVar[tuple[str, ...]] = ("FalconH1ForCausalLM",)
    gguf_architectures: ClassVar[tuple[GGUFArchitecture, ...]] = _GGUF_ARCHITECTURES
    final_norm: ClassVar[str] = "model.final_layernorm.weight"

    @classmethod
    def config_from_hf(cls, raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
        return _config_from_falcon(raw, common)

    def make_layer(
        self, config: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, index: int
    ) -> nn.Module:
        return FalconH1Layer(config, rotary, ctx, f"model.layers.{index}")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        factor = self.family.multiplier("embedding_multiplier")
        h = super().embed(input_ids)
        return h * factor if factor != 1.0 else h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        factor = self.family.multiplier("lm_head_multiplier")
        logits = super().compute_logits(hidden)
        return logits * factor if factor != 1.0 else logits

    @property
    def family(self) -> FalconH1FamilyConfig:
        return self.config.family_config(FalconH1FamilyConfig)

    def route_mlp(self, router: WeightRouter, prefix: str, mlp: nn.Module) -> None:
        super().route_mlp(router, f"{prefix.removesuffix('.mlp')}.feed_forward", mlp)

    def weight_router(self) -> WeightRouter:
        """Llama's routes, each layer's mixer's, and the multipliers folded in."""
        router = super().weight_router()
        family = self.family
        m = family.multiplier
        for i in range(self.start_layer, self.end_layer):
            layer = self.layers[i]
            assert isinstance(layer, FalconH1Layer)
            p = f"model.layers.{i}"
            layer.mamba.route(router, f"{p}.mamba")
            attention_in, key = m("attention_in_multiplier"), m("key_multiplier")
            sections = self._ssm_vector(layer.mamba)
            scales: dict[str, float | torch.Tensor] = {
                "self_attn.q_proj.weight": attention_in,
                "self_attn.k_proj.weight": attention_in * key,
                "self_attn.v_proj.weight": attention_in,
                "self_attn.o_proj.weight": m("attention_out_multiplier"),
                "mamba.out_proj.weight": m("ssm_out_multiplier"),
                "feed_forward.gate_proj.weight": family.mlp_multipliers[0],
                "feed_forward.down_proj.weight": family.mlp_multipliers[1],
                "mamba.in_proj.weight": sections * m("ssm_in_multiplier"),
            }
            if layer.self_attn.qkv_proj.bias is not None:
                scales["self_attn.k_proj.bias"] = key
                scales["self_attn.o_proj.bias"] = m("attention_out_multiplier")
            if layer.mamba.in_proj.bias is not None:
                scales["mamba.in_proj.bias"] = sections
            if layer.mamba.out_proj.bias is not None:
                scales["mamba.out_proj.bias"] = m("ssm_out_multiplier")
            for name, factor in scales.items():
                # (a GGUF file's weights come scaled, each multiplier 1, maybe in blocks)
                if bool((torch.as_tensor(factor) != 1.0).any()):
                    router.scale(f"{p}.{name}", factor)
        return router

    def _ssm_vector(self, mamba: Mamba2Layer) -> torch.Tensor:
        """The ssm_multipliers of each row of the mixer's whole in_proj (its sections:
        the gate, x, B, C and the step)."""
        sizes = mamba.in_proj.output_sizes
        factors = self.family.ssm_multipliers
        return torch.cat([torch.full((n,), f) for n, f in zip(sizes, factors, strict=True)])
