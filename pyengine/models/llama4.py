"""Llama 4's text model (Llama4ForCausalLM) on the Llama family's layers, with what it
does otherwise:

- chunked local attention on the layers with rotary embeddings (`layer_types`
  "chunked_attention": a query sees only its own chunk of `attention_chunk_size`
  positions), their KV-cache group releasing each chunk's blocks once the next begins;
- rotary embeddings in the interleaved form (pairs 2i, 2i + 1), and none on every
  `no_rope_layer_interval`-th layer (`no_rope_layers`); those NoPE layers attend to the
  whole sequence with their queries scaled by a temperature that grows with the position
  (`attn_temperature_tuning`: 1 + attn_scale * log(1 + floor((p + 1) / floor_scale)));
- q and k RMS-normed without a weight after their rotation, on the rotary layers
  (`use_qk_norm`);
- a mixture of experts on the layers `moe_layers` names (every
  `interleave_moe_layer_step`-th): a sigmoid of the top k router logits scales each
  token's input to its experts (routing "sigmoid_on_input"), beside a shared expert of
  the experts' size; the other layers are MLPs of `intermediate_size_mlp`. The
  checkpoint holds every expert of a layer in one tensor, transposed:
  `feed_forward.experts.gate_up_proj` [experts, hidden, 2 n] (the gate's columns first)
  and `down_proj` [experts, n, hidden]; a quantized one an expert at a time
  (`feed_forward.experts.E.gate_proj`...), each a linear layer of its method; a GGUF
  file (llama.cpp's llama4) a tensor per part for every expert.

The multimodal checkpoints' vision tower is not run: a text-only checkpoint
(Llama4ForCausalLM, model_type llama4_text) is.
"""

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
from pyengine.layers.moe.layer import FusedMoE
from pyengine.layers.moe.linear_experts import quantized_experts_method
from pyengine.layers.moe.methods import experts_method
from pyengine.layers.moe.routing import RoutingConfig
from pyengine.layers.quantization.shards import copy_checked
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
    MLP,
    Attention,
    DecoderLayer,
    LlamaFamilyConfig,
    LlamaForCausalLM,
    _config_from_hf,
    _Variant,
)
from pyengine.models.llama import _GGUF_LAYER_TENSORS as _LLAMA_GGUF_LAYER_TENSORS
from pyengine.models.llama_moe import (
    MoeFamilyConfig,
    gguf_expert_tensors,
    refuse_adapters,
    route_expert_linears,
    route_stacked_experts,
)
from pyengine.models.weights import WeightRouter
from pyengine.utils.lazy_weights import CheckpointTensor, materialize


@dataclass(frozen=True)
class Llama4FamilyConfig(MoeFamilyConfig):
    chunk: int = 0  # attention_chunk_size (0: none)
    chunked_layers: tuple[int, ...] = ()
    rope_layers: tuple[int, ...] = ()  # the others have no rotary embedding
    temperature_tuning: bool = False  # on the NoPE layers
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    l2_qk_norm: bool = False  # use_qk_norm: weightless, after the rotation

    def kv_spec(self, index: int, sliding_window: int) -> tuple[str, int]:
        return ("chunked", self.chunk) if index in self.chunked_layers else ("full", 0)


def _llama4_config_from_hf(raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
    layers = integer(raw["num_hidden_layers"])
    # (the dense layers' MLPs are intermediate_size_mlp wide; the experts and the shared
    # expert intermediate_size)
    config = _config_from_hf(
        {**raw, "intermediate_size": raw.get("intermediate_size_mlp", raw["intermediate_size"])},
        common, _Variant(),
    )  # fmt: skip
    interval = integer(raw.get("no_rope_layer_interval", 4))
    uses_rope = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    chunk = integer(raw.get("attention_chunk_size") or 0)
    types = raw.get("layer_types") or [
        "chunked_attention" if rope and chunk else "full_attention" for rope in uses_rope
    ]
    if len(types) != layers or len(uses_rope) != layers:
        raise ValueError(f"layer_types and no_rope_layers must name each of the {layers} layers")
    unknown = sorted(set(types) - {"chunked_attention", "full_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported")
    step = integer(raw.get("interleave_moe_layer_step", 1))
    moe_layers = raw.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, layers, step))
    experts_size = integer(raw["intermediate_size"])
    family = Llama4FamilyConfig(
        **asdict(config.family_config(LlamaFamilyConfig)),
        num_experts=integer(raw["num_local_experts"]),
        top_k=integer(raw.get("num_experts_per_tok", 1)),
        moe_intermediate_size=experts_size,
        sparse_layers=tuple(integer(i) for i in moe_layers),
        moe_module="feed_forward",
        shared_intermediate_size=experts_size,
        chunk=chunk,
        chunked_layers=tuple(i for i, kind in enumerate(types) if kind == "chunked_attention"),
        rope_layers=tuple(i for i, rope in enumerate(uses_rope) if rope),
        temperature_tuning=bool(raw.get("attn_temperature_tuning", True)),
        floor_scale=float(raw.get("floor_scale", 8192)),
        attn_scale=float(raw.get("attn_scale", 0.1)),
        l2_qk_norm=bool(raw.get("use_qk_norm", True)),
    )
    return replace(config, family=family)


# llama.cpp's Llama 4 values it keeps no key for: a chunk of 8192 positions on three
# layers of four (the fourth, NoPE, global), the NoPE layers' temperature floor and
# scale, and the weightless q/k norm but on its 128-expert model.
_GGUF_CHUNK, _GGUF_NO_ROPE_STEP, _GGUF_NO_QK_NORM_EXPERTS = 8192, 4, 128


def _llama4_config_from_gguf(m: GGUFMetadata, common: CommonValues) -> ModelConfig:
    """llama.cpp's llama4 keys and fixed values, as the config.json they were converted
    from says them (a file whose sliding_window is 0 has no chunks, and every layer
    turns)."""
    field = m.field
    layers = integer(field("block_count"))
    window = m.fields.get(f"{m.architecture}.attention.sliding_window")
    chunked = window is None or integer(window) > 0
    step = _GGUF_NO_ROPE_STEP if chunked else layers
    experts = integer(field("expert_count"))
    raw = {
        **hf_values_from_gguf(m),
        "intermediate_size": integer(field("expert_feed_forward_length")),
        "intermediate_size_mlp": integer(field("feed_forward_length")),
        "head_dim": integer(field("attention.key_length")),
        "num_local_experts": experts,
        "num_experts_per_tok": integer(field("expert_used_count")),
        "interleave_moe_layer_step": integer(field("interleave_moe_layer_step", 1)),
        "no_rope_layers": [int((i + 1) % step != 0) for i in range(layers)],
        "attention_chunk_size": _GGUF_CHUNK if chunked else 0,
        "attn_temperature_tuning": chunked,
        "use_qk_norm": experts != _GGUF_NO_QK_NORM_EXPERTS,
    }
    return _llama4_config_from_hf(raw, common)


# llama.cpp's llama4 tensors: Llama's attention, the MLPs and experts under
# feed_forward (the experts a tensor per part for every expert, the shared one apart).
_GGUF_LAYER_TENSORS = {
    **{name: hf for name, hf in _LLAMA_GGUF_LAYER_TENSORS.items() if not hf.startswith("mlp.")},
    "ffn_gate": "feed_forward.gate_proj",
    "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj",
    **gguf_expert_tensors("feed_forward", router="router"),
}
_GGUF_ARCHITECTURES = (
    GGUFArchitecture(
        "llama4", "Llama4ForCausalLM", _llama4_config_from_gguf, _GGUF_GLOBAL_TENSORS,
        _GGUF_LAYER_TENSORS, "model.layers",
    ),
)  # fmt: skip


class Llama4Attention(Attention):
    """Rotary layers: interleaved rotation, then the weightless q/k norm, chunked
    attention. NoPE layers: no rotation, queries scaled by the position's temperature."""

    def __init__(
        self, c: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, prefix: str,
        index: int,
    ) -> None:  # fmt: skip
        family = c.family_config(Llama4FamilyConfig)
        chunk = family.chunk if index in family.chunked_layers else 0
        super().__init__(c, rotary, ctx, prefix, sliding_window=0, attention_chunk=chunk)
        self.uses_rope = index in family.rope_layers
        self.l2_norm: RMSNorm | None = None
        if family.l2_qk_norm and self.uses_rope:
            self.l2_norm = RMSNorm(self.head_size, c.norm_eps)
            self.l2_norm.weight.data.fill_(1.0)  # (weightless: no checkpoint tensor)
        self.temperature = family.temperature_tuning and not self.uses_rope
        self.floor_scale, self.attn_scale = family.floor_scale, family.attn_scale

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_size)
        k = k.reshape(-1, self.num_kv_heads, self.head_size)
        v = v.reshape(-1, self.num_kv_heads, self.head_size)
        if self.uses_rope:
            self.rotary(positions, q, k)
        if self.l2_norm is not None:
            q, k = self.l2_norm(q), self.l2_norm(k)
        if self.temperature:
            steps = torch.floor((positions.float() + 1.0) / self.floor_scale)
            scales = torch.log1p(steps) * self.attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        out: torch.Tensor = self.o_proj(self.attn(q, k, v, cache, meta).view(-1, self.q_size))
        return out


class Llama4DecoderLayer(DecoderLayer):
    def __init__(
        self, c: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, index: int
    ) -> None:
        nn.Module.__init__(self)
        family = c.family_config(Llama4FamilyConfig)
        prefix = f"model.layers.{index}"
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.self_attn = Llama4Attention(c, rotary, ctx, f"{prefix}.self_attn", index)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        if index not in family.sparse_layers:
            self.mlp = MLP(c, ctx, f"{prefix}.feed_forward")
            return
        routing = RoutingConfig("sigmoid_on_input", family.top_k, family.num_experts)
        stacked = {f"{prefix}.feed_forward.experts.{part}.weight"
                   for part in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
        blocks = stacked <= ctx.linear_methods.block_quantized  # (a GGUF file's)
        self.mlp = FusedMoE(  # type: ignore[assignment]  # (its forward is an MLP's)
            c.hidden_size, family.moe_intermediate_size, routing, ctx.placement,
            family.shared_intermediate_size, False, ctx.tp, ctx.expert_parallel,
            quantized_experts_method(c.quantization, ctx) or experts_method(ctx.placement, blocks),
        )  # fmt: skip


class Llama4ForCausalLM(LlamaForCausalLM):
    hf_architectures: ClassVar[tuple[str, ...]] = ("Llama4ForCausalLM",)
    gguf_architectures: ClassVar[tuple[GGUFArchitecture, ...]] = _GGUF_ARCHITECTURES

    @classmethod
    def config_from_hf(cls, raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
        return _llama4_config_from_hf(raw, common)

    def __init__(
        self, config: ModelConfig, max_positions: int, ctx: LayerContext | None = None
    ) -> None:
        refuse_adapters(ctx)
        super().__init__(config, max_positions, ctx)

    def make_rotary(self, config: ModelConfig, max_positions: int) -> RotaryEmbedding:
        """Interleaved pairs (2i, 2i + 1), as Llama 4 turns them."""
        return RotaryEmbedding(
            config.head_size, max_positions, config.rope_theta, config.rope_scaling,
            self.placement.device, is_neox=False,
        )  # fmt: skip

    def make_layer(
        self, config: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, index: int
    ) -> nn.Module:
        return Llama4DecoderLayer(config, rotary, ctx, index)

    def route_mlp(self, router: WeightRouter, prefix: str, mlp: nn.Module) -> None:
        module = f"{prefix.removesuffix('.mlp')}.feed_forward"
        if not isinstance(mlp, FusedMoE):
            super().route_mlp(router, module, mlp)
            return
        router.plain(f"{module}.router.weight", mlp.router)
        assert mlp.shared_expert is not None
        parts = ("gate_proj", "up_proj", "down_proj")
        mlp.shared_expert.route(router, [f"{module}.shared_expert.{p}" for p in parts])
        if mlp.experts is not None:  # a quantized checkpoint's: an expert at a time
            route_expert_linears(router, f"{module}.experts", mlp, parts)
            return
        s, n, whole = mlp.shard, mlp.intermediate_size, mlp.full_intermediate_size

        def gate_up(name: str, tensor: CheckpointTensor) -> None:  # [experts, hidden, 2 n]
            mine = tensor.narrow(0, s.first, s.count)
            for into, start in (
                (mlp.gate_up[:, :n], s.start),
                (mlp.gate_up[:, n:], whole + s.start),
            ):
                copy_checked(name, into, materialize(mine.narrow(2, start, n)).transpose(1, 2))

        def down(name: str, tensor: CheckpointTensor) -> None:  # [experts, n, hidden]
            mine = tensor.narrow(0, s.first, s.count).narrow(1, s.start, n)
            copy_checked(name, mlp.down, materialize(mine).transpose(1, 2))

        # A GGUF file's form: a tensor per part for every expert, in blocks or floats.
        stacked = route_stacked_experts(router, f"{module}.experts", mlp)
        if mlp.method.keeps_blocks:
            return  # (the file's blocks: no other form)
        experts, hidden = mlp.routing.num_experts, mlp.hidden_size
        router.tensor(f"{module}.experts.gate_up_proj", (experts, hidden, 2 * whole), gate_up)
        router.tensor(f"{module}.experts.down_proj", (experts, whole, hidden), down)
        router.either(stacked, [f"{module}.experts.gate_up_proj", f"{module}.experts.down_proj"])
