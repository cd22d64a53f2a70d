"""IBM Granite 4 (GraniteMoeHybridForCausalLM): Mamba-2 layers (models/mamba2.py's
`Mamba2Layer`, under `mamba`) with attention in a few layers (`layer_types`), each
followed by experts and an ungated shared expert, or the shared MLP alone where the
config names no experts.

Granite's multipliers: the embeddings are scaled by embedding_multiplier, each
sub-layer's output by residual_multiplier before it joins the residual stream, the
attention scores by attention_multiplier (the query scale), and the logits divided by
logits_scaling. Its attention has rope or none (`position_embedding_type`). The
checkpoints hold each layer's experts in two tensors (`block_sparse_moe.input_linear`,
[experts, 2 * size, hidden], the gate's rows first, and `output_linear`), its router as
`block_sparse_moe.router.layer`, and its shared MLP's gate and up projections in one
tensor (`shared_mlp.input_linear`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from pyengine.config import RECURRENT_SPEC, ModelConfig
from pyengine.layers.attention import AttentionMetadata, KVCache
from pyengine.layers.layernorm import RMSNorm
from pyengine.layers.linear import LayerContext
from pyengine.layers.moe.layer import FusedMoE
from pyengine.layers.moe.shared import SharedExpert
from pyengine.layers.rotary import RotaryEmbedding
from pyengine.models.checkpoint_config import (
    CommonValues,
    GGUFArchitecture,
    GGUFMetadata,
    hf_values_from_gguf,
    integer,
)
from pyengine.models.llama import (
    _GGUF_GLOBAL_TENSORS,
    _GGUF_LAYER_TENSORS,
    MLP,
    Attention,
    DecoderLayer,
    LlamaForCausalLM,
    _config_from_hf,
)
from pyengine.models.llama import _Variant as _AttentionVariant
from pyengine.models.llama_moe import (
    LlamaMoeForCausalLM,
    MoeFamilyConfig,
    SharedNames,
    gguf_expert_tensors,
    route_stacked_experts,
)
from pyengine.models.mamba2 import (
    HYBRID_KEYS,
    Mamba2Layer,
    MambaSizes,
    check_mamba_split,
    gguf_mamba_sizes,
    gguf_mamba_tensors,
    mamba_values_to_hf,
)
from pyengine.models.mamba2 import mamba_sizes as read_mamba_sizes
from pyengine.models.weights import WeightRouter

_MAMBA_KINDS, _ATTENTION_KINDS = ("mamba", "linear_attention"), ("attention", "full_attention")


@dataclass(frozen=True)
class GraniteHybridFamilyConfig(MoeFamilyConfig):
    mamba_layers: tuple[int, ...] = ()
    mamba: MambaSizes = MambaSizes()
    rope: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0

    def kv_spec(self, index: int, sliding_window: int) -> tuple[str, int]:
        return RECURRENT_SPEC if index in self.mamba_layers else ("full", 0)

    def check_split(self, tensor_parallel_size: int, expert_parallel: bool) -> None:
        if self.num_experts:
            super().check_split(tensor_parallel_size, expert_parallel)
        check_mamba_split(self.mamba, tensor_parallel_size)


def _mamba_layers(raw: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    kinds = raw.get("layer_types") or raw.get("layers_block_type") or ["mamba"] * num_layers
    if not isinstance(kinds, list) or len(kinds) != num_layers:
        raise ValueError(f"layer_types must list the {num_layers} layers' kinds, got {kinds!r}")
    unknown = set(kinds) - {*_MAMBA_KINDS, *_ATTENTION_KINDS}
    if unknown:
        raise ValueError(f"layer_types: unknown layer kinds {sorted(map(str, unknown))}")
    return tuple(i for i, kind in enumerate(kinds) if kind in _MAMBA_KINDS)


def _config_from_granite(raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
    shared = integer(raw.get("shared_intermediate_size", 1024))
    experts = integer(raw.get("num_local_experts") or 0)
    expert_size = raw.get("intermediate_size", 1)  # (an expert's)
    # (ModelConfig's intermediate size is the dense MLP's: the shared one)
    raw = {**raw, "intermediate_size": shared}
    config = _config_from_hf(raw, common, _AttentionVariant())
    if experts and raw.get("shared_intermediate_size", 1) == 0:
        raise ValueError("shared_intermediate_size 0: a Granite layer without its shared MLP")
    moe: dict[str, Any] = {}
    if experts:
        moe = dict(
            num_experts=experts,
            top_k=integer(raw["num_experts_per_tok"]),
            moe_intermediate_size=integer(expert_size),
            norm_topk_prob=True,  # (the softmax of the top k's logits)
            sparse_layers=tuple(range(config.num_layers)),
            shared_intermediate_size=shared,
            shared=SharedNames("shared_intermediate_size", "shared_mlp", None),
        )
    embedding = raw.get("position_embedding_type")
    if embedding not in (None, "nope", "rope"):
        raise ValueError(f"position_embedding_type {embedding!r}: 'rope' or none expected")
    family = GraniteHybridFamilyConfig(
        **asdict(config.family), **moe,
        mamba_layers=_mamba_layers(raw, config.num_layers),
        mamba=read_mamba_sizes(
            raw,
            integer(raw.get("mamba_d_ssm") or int(float(raw.get("mamba_expand", 2))
                                                   * config.hidden_size)),
            HYBRID_KEYS,
        ),
        rope=embedding == "rope",
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        attention_multiplier=float(raw.get("attention_multiplier", 1.0)),
        logits_scaling=float(raw.get("logits_scaling", 1.0)),
    )  # fmt: skip
    return replace(config, family=family)


def _config_from_gguf(m: GGUFMetadata, common: CommonValues) -> ModelConfig:
    """llama.cpp's granitehybrid keys as the config.json they came from says them: the
    attention layers are those with KV heads (head_count_kv per layer, 0 on the Mamba-2
    ones), rope where rope.scaling.finetuned says (Bamba; Granite 4 has none), the
    multipliers as its scales."""
    kv_heads = m.field("attention.head_count_kv")
    per_layer = None if isinstance(kv_heads, int | float) else [int(n) for n in kv_heads]
    values = hf_values_from_gguf(_scalar_kv(m))
    layers = values["num_hidden_layers"]
    if per_layer is not None and len(per_layer) != layers:
        raise ValueError(f"attention.head_count_kv lists {len(per_layer)} layers, not {layers}")
    kinds = ["attention" if per_layer is None or per_layer[i] else "mamba" for i in range(layers)]
    mamba_layer = kinds.index("mamba") if "mamba" in kinds else 0
    field = m.field
    raw: dict[str, Any] = {
        **values, "layer_types": kinds,
        "intermediate_size": integer(field("feed_forward_length", 1)),
        "shared_intermediate_size": integer(
            field("expert_shared_feed_forward_length", field("feed_forward_length", 0))
        ),
        "num_local_experts": integer(field("expert_count", 0)),
        "num_experts_per_tok": integer(field("expert_used_count", 0)),
        "position_embedding_type": "rope" if field("rope.scaling.finetuned", False) else "nope",
        "embedding_multiplier": float(field("embedding_scale", 1.0)),
        "residual_multiplier": float(field("residual_scale", 1.0)),
        "attention_multiplier": float(field("attention.scale", 1.0)),
        "logits_scaling": float(field("logit_scale", 1.0)),
        "mamba_d_ssm": integer(field("ssm.inner_size")),
        **gguf_mamba_sizes(m, mamba_layer, HYBRID_KEYS),
    }  # fmt: skip
    return _config_from_granite(raw, common)


def _scalar_kv(m: GGUFMetadata) -> GGUFMetadata:
    """The metadata with head_count_kv one number (the most any layer has), as the
    values every architecture shares read it."""
    kv = m.field("attention.head_count_kv")
    if isinstance(kv, int | float):
        return m
    fields = {**m.fields, f"{m.architecture}.attention.head_count_kv": max(map(int, kv), default=0)}
    return GGUFMetadata(fields, m.tensor_names, m.architecture)


_GGUF_ARCHITECTURES = (
    GGUFArchitecture(
        "granitehybrid", "GraniteMoeHybridForCausalLM", _config_from_gguf, _GGUF_GLOBAL_TENSORS,
        {**{part: name for part, name in _GGUF_LAYER_TENSORS.items()
            if part.startswith("attn_") or part == "ffn_norm"},
         **gguf_mamba_tensors("mamba"),
         **gguf_expert_tensors("block_sparse_moe", router="router.layer", shared=None),
         **{f"ffn_{part}{kind}": f"shared_mlp.{part}_proj" for part in ("gate", "up", "down")
            for kind in ("", "_shexp")}},
        "model.layers", rope_permuted=True, to_hf=mamba_values_to_hf,
    ),
)  # fmt: skip


class GraniteHybridLayer(DecoderLayer):
    """A Mamba-2 layer or attention (held as self_attn either way), then experts with a
    shared expert, or the shared MLP; each output scaled by residual_multiplier."""

    def __init__(
        self, c: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, prefix: str,
        mamba: bool,
    ) -> None:  # fmt: skip
        nn.Module.__init__(self)
        family = c.family_config(GraniteHybridFamilyConfig)
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        mixer: nn.Module = (
            Mamba2Layer(c.hidden_size, family.mamba, c.norm_eps, ctx, f"{prefix}.mamba")
            if mamba
            else Attention(
                c, rotary, ctx, f"{prefix}.self_attn", scale=family.attention_multiplier
            )  # fmt: skip
        )
        self.self_attn = mixer  # type: ignore[assignment]
        self.rope = family.rope
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.mlp = MLP(c, ctx, f"{prefix}.shared_mlp")
        self.residual_multiplier = family.residual_multiplier

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
        cache: KVCache, meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        h, residual = self.enter(h, residual)
        # (NoPE attention: its positions play no part; position 0 turns nothing)
        at = positions if self.rope else torch.zeros_like(positions)
        h = self.self_attn(h, at, cache, meta) * self.residual_multiplier
        self.post_attention_layernorm.add_residual(h, residual)
        return self.mlp(h) * self.residual_multiplier, residual


class GraniteMoeHybridForCausalLM(LlamaMoeForCausalLM):
    hf_architectures: ClassVar[tuple[str, ...]] = ("GraniteMoeHybridForCausalLM",)
    gguf_architectures: ClassVar[tuple[GGUFArchitecture, ...]] = _GGUF_ARCHITECTURES

    @classmethod
    def config_from_hf(cls, raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
        return _config_from_granite(raw, common)

    def __init__(
        self, config: ModelConfig, max_positions: int, ctx: LayerContext | None = None
    ) -> None:
        if config.family_config(GraniteHybridFamilyConfig).num_experts:
            super().__init__(config, max_positions, ctx)
        else:  # (the shared MLP alone)
            LlamaForCausalLM.__init__(self, config, max_positions, ctx)

    def make_layer(
        self, config: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, index: int
    ) -> nn.Module:
        mamba = index in config.family_config(GraniteHybridFamilyConfig).mamba_layers
        return GraniteHybridLayer(config, rotary, ctx, f"model.layers.{index}", mamba)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = super().embed(input_ids)
        factor = self.config.family_config(GraniteHybridFamilyConfig).embedding_multiplier
        return h * factor if factor != 1.0 else h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        scaling = self.config.family_config(GraniteHybridFamilyConfig).logits_scaling
        logits = super().compute_logits(hidden)
        return logits / scaling if scaling != 1.0 else logits

    def route_attention(self, router: WeightRouter, prefix: str, attn: nn.Module) -> None:
        if isinstance(attn, Mamba2Layer):
            attn.route(router, f"{prefix.removesuffix('.self_attn')}.mamba")
        else:
            super().route_attention(router, prefix, attn)

    def route_mlp(self, router: WeightRouter, prefix: str, mlp: nn.Module) -> None:
        """The checkpoints' fused tensors (input_linear: the gate's rows, then up's), or a
        GGUF file's parts apart (the experts a tensor a part, the shared MLP's gate, up
        and down)."""
        layer = prefix.removesuffix(".mlp")
        shared = f"{layer}.shared_mlp"
        parts = [f"{shared}.{part}_proj" for part in ("gate", "up", "down")]
        gguf = [f"{module}.weight" for module in parts]
        hf = [f"{shared}.input_linear.weight", f"{shared}.output_linear.weight"]
        if isinstance(mlp, MLP):
            router.fused(hf[0], mlp.gate_up_proj, "weight")
            router.linear_weight(hf[1].removesuffix(".weight"), mlp.down_proj)
            router.linear_weight(parts[0], mlp.gate_up_proj, part=0)
            router.linear_weight(parts[1], mlp.gate_up_proj, part=1)
            router.linear_weight(parts[2], mlp.down_proj)
            router.either(hf, gguf)
            return
        assert isinstance(mlp, FusedMoE)
        if mlp.experts is not None or mlp.shared_expert is None:
            raise ValueError("Granite 4's experts load from float checkpoints or GGUF files only")
        module = f"{layer}.block_sparse_moe"
        router.plain(f"{module}.router.layer.weight", mlp.router)
        mlp.shared_expert.route(router, parts)
        gguf += route_stacked_experts(router, f"{module}.experts", mlp)
        expert = mlp.shared_expert
        if mlp.method.keeps_blocks or not isinstance(expert, SharedExpert):
            return  # (a GGUF file's blocks: no other form)
        tensors = mlp.fused_tensors()
        for name, ours in (("input_linear", "gate_up_proj"), ("output_linear", "down_proj")):
            hf.append(f"{module}.{name}.weight")
            router.tensor(hf[-1], *tensors[ours])
        part = (expert.whole, expert.start, expert.intermediate_size)
        router.sections(hf[0], expert.gate_up.data, [part, part])
        router.shard(hf[1], expert.down.data, 1, expert.start, expert.whole)
        router.either(hf, gguf)
