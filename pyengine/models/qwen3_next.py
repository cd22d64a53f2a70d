"""Qwen3-Next and Qwen3.5 (text): hybrid models whose layers are Gated DeltaNet
(`linear_attention`) three of every four, with a recurrent state per request instead
of a KV cache, and gated full attention in the fourth.

Beside Qwen3-MoE's layers they have:
- Gated DeltaNet mixers (layers/gated_delta_net.py) between an input projection and an
  output projection; Qwen3-Next's projection interleaves each key head's query, key,
  values and gates (in_proj_qkvz, in_proj_ba), Qwen3.5's holds them apart (in_proj_qkv,
  in_proj_z, in_proj_b, in_proj_a);
- full attention whose q_proj gives each head's query and a gate of its output
  (sigmoid), per-head q/k RMSNorms, and rope on the first quarter of each head only
  (partial_rotary_factor);
- RMSNorms that scale by 1 + w (zero-centred weights), loaded as 1 + w as Gemma's;
- experts with a shared expert behind a sigmoid gate (Qwen3-Next, Qwen3.5-MoE), or a
  dense MLP (Qwen3.5).
The recurrent layers' states live in slots the KV-cache manager hands out
(worker/state_pool.py); their layers are RECURRENT_SPEC in the KV layout."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from pyengine.config import RECURRENT_SPEC, ModelConfig
from pyengine.layers.attention import AttentionMetadata, KVCache
from pyengine.layers.gated_delta_net import (
    DeltaNetShape,
    GatedDeltaNetMixer,
    split_ba,
    split_qwen3_5,
    split_qwen3_next,
)
from pyengine.layers.layernorm import RMSNorm
from pyengine.layers.linear import (
    ColumnParallelLinear,
    LayerContext,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from pyengine.layers.recurrent_state import (
    RecurrentStates,
    mixer_parameter,
    rank_sections,
)
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
    _Variant,
)
from pyengine.models.llama_moe import (
    _GGUF_EXPERT_TENSORS,
    _QWEN2_SHARED,
    LlamaMoeForCausalLM,
    MoeFamilyConfig,
    refuse_adapters,
    sparse_layers,
)
from pyengine.models.mamba2 import mamba_values_to_hf
from pyengine.models.weights import WeightRouter


@dataclass(frozen=True)
class DeltaNetSizes:
    """A Gated DeltaNet layer's whole sizes (config.json's linear_* keys)."""

    key_heads: int = 0
    value_heads: int = 0
    key_dim: int = 0
    value_dim: int = 0
    conv_width: int = 0


@dataclass(frozen=True)
class HybridFamilyConfig(MoeFamilyConfig):
    """Which layers are Gated DeltaNet, their sizes, the projection layout, and the
    rotary part of each attention head. The layouts: "qwen3_next" (in_proj_qkvz and
    in_proj_ba, each interleaved by key head), "qwen3_5" (q, k and v, the gate, b and a
    apart), and "qwen3_next_split", Qwen3-Next as llama.cpp stores it (q, k and v, and
    the gate apart; b and a still interleaved)."""

    linear_layers: tuple[int, ...] = ()
    delta: DeltaNetSizes = DeltaNetSizes()
    layout: str = "qwen3_next"
    rotary_dim: int = 0

    def kv_spec(self, index: int, sliding_window: int) -> tuple[str, int]:
        return RECURRENT_SPEC if index in self.linear_layers else ("full", 0)

    def check_split(self, tensor_parallel_size: int, expert_parallel: bool) -> None:
        if self.num_experts:
            super().check_split(tensor_parallel_size, expert_parallel)
        for name, heads in (("linear_num_key_heads", self.delta.key_heads),
                            ("linear_num_value_heads", self.delta.value_heads)):  # fmt: skip
            if heads % tensor_parallel_size:
                raise ValueError(
                    f"the model's {name} ({heads}) is not divisible by tensor_parallel_size "
                    f"{tensor_parallel_size}"
                )


@dataclass(frozen=True)
class _HybridVariant:
    layout: str
    experts: bool  # the config names experts (their layers as Qwen3-MoE's keys say)
    renormalize: bool | None  # None: as norm_topk_prob says (default True)


_HF_VARIANTS = {
    "Qwen3NextForCausalLM": _HybridVariant("qwen3_next", experts=True, renormalize=None),
    "Qwen3_5ForCausalLM": _HybridVariant("qwen3_5", experts=False, renormalize=None),
    "Qwen3_5MoeForCausalLM": _HybridVariant("qwen3_5", experts=True, renormalize=True),
}


def _linear_layers(raw: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """The Gated DeltaNet layers: as layer_types says, or all but every
    full_attention_interval-th."""
    kinds = raw.get("layer_types")
    if kinds is None:
        interval = integer(raw.get("full_attention_interval", 4))
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(num_layers)]  # fmt: skip
    if not isinstance(kinds, list) or len(kinds) != num_layers:
        raise ValueError(f"layer_types must list the {num_layers} layers' kinds, got {kinds!r}")
    unknown = set(kinds) - {"linear_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer_types: unknown layer kinds {sorted(map(str, unknown))}")
    return tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")


def _rotary_dim(raw: Mapping[str, Any], head_size: int) -> int:
    """The rotary dims of a head: a share of it (partial_rotary_factor), or as a GGUF
    file counts them (rotary_dim)."""
    parameters = raw.get("rope_parameters") or {}
    factor = raw.get("partial_rotary_factor", parameters.get("partial_rotary_factor", 0.25))
    rotary = integer(raw["rotary_dim"]) if "rotary_dim" in raw else int(head_size * float(factor))
    if not 0 < rotary <= head_size or rotary % 2:
        raise ValueError(
            f"partial_rotary_factor {factor} turns {rotary} of {head_size} head dims; an even "
            "number from 2 to the head size is needed"
        )
    return rotary


def _config_from_hybrid(raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
    variant = _HF_VARIANTS[common.architecture]
    if "intermediate_size" not in raw:  # (Qwen3.5-MoE's: experts in every layer)
        raw = {**raw, "intermediate_size": raw.get("moe_intermediate_size", 1)}
    config = _config_from_hf(raw, common, _Variant(qk_norm=True))
    n = config.num_layers
    moe: dict[str, Any] = {}
    if variant.experts and integer(raw.get("num_experts", 0)) > 0:
        renormalize = variant.renormalize
        if renormalize is None:
            renormalize = bool(raw.get("norm_topk_prob", True))
        moe = dict(
            num_experts=integer(raw["num_experts"]),
            top_k=integer(raw["num_experts_per_tok"]),
            moe_intermediate_size=integer(raw["moe_intermediate_size"]),
            norm_topk_prob=renormalize,
            sparse_layers=sparse_layers(raw, n),
            shared_intermediate_size=integer(raw["shared_expert_intermediate_size"]),
            shared=_QWEN2_SHARED,
        )
    delta = DeltaNetSizes(
        key_heads=integer(raw["linear_num_key_heads"]),
        value_heads=integer(raw["linear_num_value_heads"]),
        key_dim=integer(raw["linear_key_head_dim"]),
        value_dim=integer(raw["linear_value_head_dim"]),
        conv_width=integer(raw.get("linear_conv_kernel_dim", 4)),
    )
    for name, value in asdict(delta).items():
        if value < 1:
            raise ValueError(f"the Gated DeltaNet's {name} must be positive, got {value}")
    if delta.value_heads % delta.key_heads:
        raise ValueError(
            f"linear_num_value_heads ({delta.value_heads}) must be a multiple of "
            f"linear_num_key_heads ({delta.key_heads})"
        )
    attention = asdict(config.family)
    family = HybridFamilyConfig(
        **attention, **moe, linear_layers=_linear_layers(raw, n), delta=delta,
        layout=variant.layout, rotary_dim=_rotary_dim(raw, config.head_size),
    )  # fmt: skip
    return replace(config, family=family)


def _config_from_gguf(m: GGUFMetadata, common: CommonValues) -> ModelConfig:
    """llama.cpp's qwen3next, qwen35 and qwen35moe keys as the config.json they came from
    says them: the Gated DeltaNet's sizes as ssm.* keys (its key heads the groups, its
    value heads the time-step rank, its key head size the state size), the rotary dims
    counted, experts in the layers that have a router (their top k renormalised, as
    llama.cpp does). Qwen3-Next's projection comes split (`qwen3_next_split`)."""
    field = m.field
    value_heads = integer(field("ssm.time_step_rank"))
    head_dim = integer(field("attention.key_length"))
    raw: dict[str, Any] = {
        **hf_values_from_gguf(m), "head_dim": head_dim,
        "full_attention_interval": integer(field("full_attention_interval", 4)),
        "linear_num_key_heads": integer(field("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": integer(field("ssm.state_size")),
        "linear_value_head_dim": integer(field("ssm.inner_size")) // max(value_heads, 1),
        "linear_conv_kernel_dim": integer(field("ssm.conv_kernel")),
        "rotary_dim": integer(field("rope.dimension_count", head_dim // 4)),
    }  # fmt: skip
    if f"{m.architecture}.feed_forward_length" in m.fields:  # (Qwen3.5-MoE's has none)
        raw["intermediate_size"] = integer(field("feed_forward_length"))
    if integer(field("expert_count", 0)) > 0:
        layers = raw["num_hidden_layers"]
        raw.update(
            num_experts=integer(field("expert_count")),
            num_experts_per_tok=integer(field("expert_used_count")),
            moe_intermediate_size=integer(field("expert_feed_forward_length")),
            shared_expert_intermediate_size=integer(field("expert_shared_feed_forward_length")),
            norm_topk_prob=bool(field("expert_weights_norm", True)),
            mlp_only_layers=[i for i in range(layers)
                             if f"blk.{i}.ffn_gate_inp.weight" not in m.tensor_names],
        )  # fmt: skip
    config = _config_from_hybrid(raw, common)
    if m.architecture != "qwen3next":
        return config
    family = replace(config.family_config(HybridFamilyConfig), layout="qwen3_next_split")
    return replace(config, family=family)


def _to_hf(name: str, values: Any, config: ModelConfig) -> Any:
    """llama.cpp stores the norms that scale by 1 + w as that (the mixer's gated norm,
    which scales by w, as it is) and A as -exp(A_log); Qwen3.5's output projection
    takes its value heads' columns in its own order."""
    if name.endswith(".A_log"):
        return mamba_values_to_hf(name, values, config)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return values - 1
    family = config.family_config(HybridFamilyConfig)
    if name.endswith("linear_attn.out_proj.weight") and family.layout == "qwen3_5":
        order = _value_rows(family.delta, family.delta.value_dim)
        return values if order is None else values[:, order]
    return values


def _value_rows(d: DeltaNetSizes, size: int) -> Any:
    """Rows of the value heads (`size` each) in Hugging Face's order, grouped by key head,
    as indices into llama.cpp's qwen35 rows, tiled (each key head's first value head,
    then each one's second...); None where each key head has one value head."""
    per = d.value_heads // d.key_heads
    if per == 1:
        return None
    heads = np.arange(d.value_heads)
    stored = heads % per * d.key_heads + heads // per
    return (stored[:, None] * size + np.arange(size)).reshape(-1)


def _qwen3_5_row_order(name: str, config: ModelConfig) -> Any:
    """The rows llama.cpp's qwen35 conversion reorders: the value heads' rows of the
    projections, the convolution's value channels, and A and dt_bias."""
    d = config.family_config(HybridFamilyConfig).delta
    if ".linear_attn." not in name or d.value_heads == d.key_heads:
        return None
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        keys = 2 * d.key_heads * d.key_dim
        return np.concatenate([np.arange(keys), keys + _value_rows(d, d.value_dim)])
    if name.endswith("in_proj_z.weight"):
        return _value_rows(d, d.value_dim)
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", ".A_log", ".dt_bias")):
        return _value_rows(d, 1)
    return None


_GGUF_DELTA_TENSORS = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log", "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}  # fmt: skip
_GGUF_ARCHITECTURES = (
    GGUFArchitecture(
        "qwen3next", "Qwen3NextForCausalLM", _config_from_gguf, _GGUF_GLOBAL_TENSORS,
        {**_GGUF_LAYER_TENSORS, **_GGUF_EXPERT_TENSORS, **_GGUF_DELTA_TENSORS,
         "ssm_ba": "linear_attn.in_proj_ba"},
        "model.layers", to_hf=_to_hf,
    ),
    *(GGUFArchitecture(
        name, hf, _config_from_gguf, _GGUF_GLOBAL_TENSORS,
        {**_GGUF_LAYER_TENSORS, **_GGUF_EXPERT_TENSORS, **_GGUF_DELTA_TENSORS,
         "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a"},
        "model.layers", to_hf=_to_hf, row_order=_qwen3_5_row_order,
        # (the output projection's columns reordered: dequantized, then put back)
        keeps_blocks=lambda hf_name: not hf_name.endswith("linear_attn.out_proj.weight"),
    ) for name, hf in (("qwen35", "Qwen3_5ForCausalLM"), ("qwen35moe", "Qwen3_5MoeForCausalLM"))),
)  # fmt: skip


class GatedAttention(Attention):
    """Full attention whose output is gated per head by sigmoid of a second half of each
    head's q_proj rows, and whose rope turns each head's first rotary_dim dims."""

    query_parts = 2

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        assert self.q_norm is not None and self.k_norm is not None
        qkv = self.qkv_proj(x)
        query_gate, k, v = torch.split(qkv, [2 * self.q_size, self.kv_size, self.kv_size], -1)
        query_gate = query_gate.view(-1, self.num_heads, 2 * self.head_size)
        q, gate = torch.split(query_gate, [self.head_size, self.head_size], dim=-1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_size))
        v = v.reshape(-1, self.num_kv_heads, self.head_size)
        # (the kernel turns dense heads: the rotary part is copied out and back)
        rotary = self.rotary.cos_sin_cache.shape[1]
        q_rot, k_rot = q[..., :rotary].contiguous(), k[..., :rotary].contiguous()
        self.rotary(positions, q_rot, k_rot)
        q[..., :rotary], k[..., :rotary] = q_rot, k_rot
        out = self.attn(q, k, v, cache, meta) * torch.sigmoid(gate)
        result: torch.Tensor = self.o_proj(out.reshape(-1, self.q_size))
        return result


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer: its projections, its mixer's parameters, and its states
    (a StateLayer: the model runner hands it its slots' tensors as its cache)."""

    def __init__(self, c: ModelConfig, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        family = c.family_config(HybridFamilyConfig)
        d, tp = family.delta, ctx.tp
        self.layout = family.layout
        self.shape = DeltaNetShape(d.key_heads // tp.world_size, d.value_heads // tp.world_size,
                                   d.key_dim, d.value_dim, d.conv_width, c.norm_eps)  # fmt: skip
        key_size, value_size = d.key_heads * d.key_dim, d.value_heads * d.value_dim
        hidden = c.hidden_size

        def names(*parts: str) -> list[str]:
            return [f"{prefix}.{part}.weight" for part in parts]

        # (each key head's rows together where interleaved: split over the ranks whole)
        self.fused_ba = self.layout in ("qwen3_next", "qwen3_next_split")
        if self.layout == "qwen3_next":
            self.in_proj_qkvz = ColumnParallelLinear(
                hidden, [2 * key_size + 2 * value_size], False, ctx, names("in_proj_qkvz")
            )
        else:
            self.in_proj_qkv = MergedColumnParallelLinear(
                hidden, [key_size, key_size, value_size], False, ctx, names("in_proj_qkv")
            )
            self.in_proj_z = ColumnParallelLinear(
                hidden, [value_size], False, ctx, names("in_proj_z")
            )
        if self.fused_ba:
            self.in_proj_ba = ColumnParallelLinear(
                hidden, [2 * d.value_heads], False, ctx, names("in_proj_ba")
            )
        else:
            self.in_proj_ba = MergedColumnParallelLinear(
                hidden, [d.value_heads, d.value_heads], False, ctx,
                names("in_proj_b", "in_proj_a"),
            )  # fmt: skip
        self.out_proj = RowParallelLinear(value_size, hidden, False, ctx, names("out_proj"))
        s, device = self.shape, ctx.placement.device
        # The convolution's channels are the queries', keys' and values' (each split
        # over the ranks, in that order), as the projections give them to the mixer.
        self.conv_sections = rank_sections((key_size, key_size, value_size), tp)
        self.value_heads_start = tp.rank * s.value_heads
        self.whole_value_heads = d.value_heads
        self.conv_weight = mixer_parameter(s.conv_channels, s.conv_width, device=device)
        self.A_log = mixer_parameter(s.value_heads, device=device)
        self.dt_bias = mixer_parameter(s.value_heads, device=device)
        self.norm_weight = mixer_parameter(s.value_dim, device=device)
        self.mixer: GatedDeltaNetMixer | None = None
        self.state_index = 0  # (the model runner's to set)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        s = self.shape
        return (s.conv_channels, s.conv_width - 1), (s.value_heads, s.key_dim, s.value_dim)

    def process_weights_after_loading(self) -> None:
        self.mixer = GatedDeltaNetMixer(
            self.shape, self.conv_weight.data, self.A_log.data, self.dt_bias.data,
            self.norm_weight.data,
        )  # fmt: skip

    def route(self, router: WeightRouter, prefix: str) -> None:
        """Its checkpoint tensors, under `prefix` (the layer's linear_attn)."""
        if self.layout == "qwen3_next":
            router.linear_weight(f"{prefix}.in_proj_qkvz", self.in_proj_qkvz)
        else:
            router.fused(f"{prefix}.in_proj_qkv.weight", self.in_proj_qkv, "weight")
            router.linear_weight(f"{prefix}.in_proj_z", self.in_proj_z)
        if self.fused_ba:
            router.linear_weight(f"{prefix}.in_proj_ba", self.in_proj_ba)
        else:
            router.linear_weight(f"{prefix}.in_proj_b", self.in_proj_ba, part=0)
            router.linear_weight(f"{prefix}.in_proj_a", self.in_proj_ba, part=1)
        router.linear_weight(f"{prefix}.out_proj", self.out_proj)
        router.sections(f"{prefix}.conv1d.weight", self.conv_weight.data, self.conv_sections)
        for name, into in (("A_log", self.A_log), ("dt_bias", self.dt_bias)):
            router.shard(f"{prefix}.{name}", into.data, 0, self.value_heads_start,
                         self.whole_value_heads)  # fmt: skip
        router.plain(f"{prefix}.norm.weight", self.norm_weight)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        """(`cache`: none, NO_PAGES; its states are the step's)"""
        assert self.mixer is not None, "process_weights_after_loading makes the mixer"
        del positions, cache  # (a recurrence knows its order)
        states = RecurrentStates.of_step(meta, self.state_index)
        if self.layout == "qwen3_next":
            inputs = split_qwen3_next(self.in_proj_qkvz(x), self.in_proj_ba(x), self.shape)
        else:
            ba = self.in_proj_ba(x)
            b, a = split_ba(ba, self.shape) if self.fused_ba else ba.chunk(2, dim=-1)
            inputs = split_qwen3_5(self.in_proj_qkv(x), self.in_proj_z(x), b, a, self.shape)
        out: torch.Tensor = self.out_proj(self.mixer(inputs, states).to(x.dtype))
        return out


class HybridDecoderLayer(DecoderLayer):
    """A decoder layer whose token mixer is Gated DeltaNet or gated attention (held as
    self_attn either way, so that DecoderLayer's forward runs both)."""

    def __init__(
        self, c: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, prefix: str,
        linear: bool,
    ) -> None:  # fmt: skip
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        mixer: nn.Module = (GatedDeltaNet(c, ctx, f"{prefix}.linear_attn") if linear
                            else GatedAttention(c, rotary, ctx, f"{prefix}.self_attn"))  # fmt: skip
        self.self_attn = mixer  # type: ignore[assignment]
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.mlp = MLP(c, ctx, f"{prefix}.mlp")


class Qwen3NextForCausalLM(LlamaMoeForCausalLM):
    hf_architectures: ClassVar[tuple[str, ...]] = tuple(_HF_VARIANTS)
    gguf_architectures: ClassVar[tuple[GGUFArchitecture, ...]] = _GGUF_ARCHITECTURES

    @classmethod
    def config_from_hf(cls, raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
        return _config_from_hybrid(raw, common)

    def __init__(
        self, config: ModelConfig, max_positions: int, ctx: LayerContext | None = None
    ) -> None:
        if config.family_config(HybridFamilyConfig).num_experts:
            super().__init__(config, max_positions, ctx)
        else:  # (Qwen3.5's dense MLPs: no experts to place)
            refuse_adapters(ctx)
            LlamaForCausalLM.__init__(self, config, max_positions, ctx)

    def make_rotary(self, config: ModelConfig, max_positions: int) -> RotaryEmbedding:
        """Rope on each head's first rotary_dim dims (rotate-half pairs among them)."""
        rotary_dim = config.family_config(HybridFamilyConfig).rotary_dim
        return RotaryEmbedding(rotary_dim, max_positions, config.rope_theta, config.rope_scaling,
                               self.placement.device)  # fmt: skip

    def make_layer(
        self, config: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, index: int
    ) -> nn.Module:
        linear = index in config.family_config(HybridFamilyConfig).linear_layers
        return HybridDecoderLayer(config, rotary, ctx, f"model.layers.{index}", linear)

    def route_norm(self, router: WeightRouter, name: str, norm: RMSNorm) -> None:
        """Its RMSNorms scale by (1 + w): the weight is loaded as that."""
        router.plus_one(name, norm.weight)

    def route_attention(self, router: WeightRouter, prefix: str, attn: nn.Module) -> None:
        if isinstance(attn, GatedDeltaNet):
            attn.route(router, f"{prefix.removesuffix('.self_attn')}.linear_attn")
        else:
            super().route_attention(router, prefix, attn)
