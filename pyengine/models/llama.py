"""The Llama family (Llama 2/3, SmolLM2, Mistral) and Qwen2/Qwen3, which differ from it
only in q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3) and a sliding window
(Mistral). The family reads its own config, from a config.json or a GGUF file.

The step's tokens are one flat batch [num_tokens, hidden]: no padding, no per-request
loop; attention goes through the paged KV cache. q/k/v and gate/up are each one matmul.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from pyengine.config import FamilyConfig, ModelConfig
from pyengine.distributed import IntermediateTensors
from pyengine.layers.attention import AttentionMetadata, KVCache, PagedAttention
from pyengine.layers.block_quantized import BlockQuantized
from pyengine.layers.layernorm import ProjectionRMSNorm, RMSNorm, stream_sum
from pyengine.layers.linear import (
    ColumnParallelLinear,
    LayerContext,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    process_weights_after_loading,
)
from pyengine.layers.rotary import RotaryEmbedding
from pyengine.layers.vocab_embedding import VocabParallelEmbedding, stage_lm_head
from pyengine.models.checkpoint_config import (
    CommonValues,
    GGUFArchitecture,
    GGUFMetadata,
    head_size_of,
    integer,
)
from pyengine.models.weights import WeightRouter
from pyengine.utils.lazy_weights import CheckpointTensor


@dataclass(frozen=True)
class LlamaFamilyConfig(FamilyConfig):
    """Where a member of the family differs from Llama in its layers."""

    attention_bias: bool = False  # the q/k/v projections have biases (Qwen2)
    qk_norm: bool = False  # an RMSNorm of q and of k per head (Qwen3)
    qk_norm_whole: bool = False  # those norms over each whole projection instead (OLMoE)
    clip_qkv: float = 0.0  # q, k and v clamped to [-clip_qkv, clip_qkv] (OLMoE's; 0: none)
    # A window on some layers only (Gemma's, gpt-oss's `layer_types`): its size, and the
    # layers that have it (the others attend to all).
    window: int = 0
    sliding_layers: tuple[int, ...] = ()

    def layer_window(self, index: int) -> int:
        """Layer `index`'s window where the family gives some layers one (0: none)."""
        return self.window if index in self.sliding_layers else 0

    def kv_spec(self, index: int, sliding_window: int) -> tuple[str, int]:
        if not self.sliding_layers:
            return super().kv_spec(index, sliding_window)
        window = self.layer_window(index)
        return ("sliding", window) if window else ("full", 0)


@dataclass(frozen=True)
class _Variant:
    """How one Hugging Face architecture of the family reads its config.json: the default
    of its attention_bias, whether it has q/k norms, whether it reads sliding_window."""

    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: bool = False
    qk_norm_whole: bool = False


# The Hugging Face architectures this module runs.
_HF_VARIANTS = {
    "LlamaForCausalLM": _Variant(),
    "MistralForCausalLM": _Variant(sliding_window=True),
    "Qwen2ForCausalLM": _Variant(attention_bias=True),
    "Qwen3ForCausalLM": _Variant(qk_norm=True),
    # (its checkpoints hold q/k/v in one qkv_proj and gate/up in one gate_up_proj)
    "Phi3ForCausalLM": _Variant(sliding_window=True),
}


def _config_from_hf(
    raw: Mapping[str, Any], common: CommonValues, variant: _Variant | None = None
) -> ModelConfig:
    variant = variant or _HF_VARIANTS[common.architecture]
    heads = integer(raw["num_attention_heads"])
    hidden = integer(raw["hidden_size"])
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    kv_heads = integer(raw.get("num_key_value_heads") or heads)
    if kv_heads >= 1 and heads % kv_heads:  # named as config.json names it
        raise ValueError(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    return ModelConfig(
        architecture=common.architecture,
        vocab_size=integer(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=integer(raw["intermediate_size"]),
        num_layers=integer(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=integer(raw.get("head_dim") or head_size_of(hidden, heads)),
        max_position_embeddings=integer(raw.get("max_position_embeddings", 2048)),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=common.rope_theta,
        rope_scaling=common.rope_scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_window=integer(window or 0) if variant.sliding_window else 0,
        bos_token_id=common.bos_token_id,
        eos_token_ids=common.eos_token_ids,
        family=LlamaFamilyConfig(
            attention_bias=bool(raw.get("attention_bias", variant.attention_bias)),
            qk_norm=variant.qk_norm,
            qk_norm_whole=variant.qk_norm_whole,
            clip_qkv=float(raw.get("clip_qkv") or 0.0),
        ),
    )


def _config_from_gguf(m: GGUFMetadata, common: CommonValues) -> ModelConfig:
    """llama.cpp's keys; the biases and q/k norms are there when their tensors are."""
    heads = int(m.field("attention.head_count"))
    hidden = int(m.field("embedding_length"))
    vocab = m.fields.get(f"{m.architecture}.vocab_size", len(m.fields["tokenizer.ggml.tokens"]))
    return ModelConfig(
        architecture=common.architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(m.field("feed_forward_length")),
        num_layers=int(m.field("block_count")),
        num_heads=heads,
        num_kv_heads=int(m.field("attention.head_count_kv", heads)),
        head_size=int(m.field("attention.key_length", hidden // heads)),
        max_position_embeddings=int(m.field("context_length", 2048)),
        norm_eps=float(m.field("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=common.rope_theta,
        rope_scaling=common.rope_scaling,
        tie_word_embeddings="output.weight" not in m.tensor_names,
        sliding_window=int(m.fields.get(f"{m.architecture}.attention.sliding_window", 0) or 0),
        bos_token_id=common.bos_token_id,
        eos_token_ids=common.eos_token_ids,
        family=LlamaFamilyConfig(
            attention_bias="blk.0.attn_q.bias" in m.tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in m.tensor_names,
        ),
    )


# llama.cpp's tensor names (outside the layers, and within blk.N) and the family's.
_GGUF_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_TENSORS = {
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


def _gguf(
    name: str, hf_architecture: str, rope_permuted: bool,
    layer_tensors: Mapping[str, str] | None = None,
) -> GGUFArchitecture:  # fmt: skip
    """`layer_tensors`: the architecture's names beside (or instead of) Llama's."""
    return GGUFArchitecture(
        name, hf_architecture, _config_from_gguf, _GGUF_GLOBAL_TENSORS,
        {**_GGUF_LAYER_TENSORS, **(layer_tensors or {})}, "model.layers", rope_permuted,
    )  # fmt: skip


# The llama.cpp architectures this module runs (its Llama conversion, which Mistral's
# shares, permutes the q/k rows for its rope; its Qwen ones do not).
_GGUF_ARCHITECTURES = (
    _gguf("llama", "LlamaForCausalLM", rope_permuted=True),
    _gguf("mistral", "MistralForCausalLM", rope_permuted=True),
    _gguf("qwen2", "Qwen2ForCausalLM", rope_permuted=False),
    _gguf("qwen3", "Qwen3ForCausalLM", rope_permuted=False),
    # (Phi-3's q/k/v and gate/up fused, as its checkpoints hold them)
    _gguf("phi3", "Phi3ForCausalLM", rope_permuted=False,
          layer_tensors={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}),
)  # fmt: skip


class Attention(nn.Module):
    # Each query head's parts in q_proj: 2 where a head's query comes with a gate of its
    # output (Qwen3-Next's gated attention, whose layer splits them).
    query_parts: ClassVar[int] = 1

    def __init__(
        self, c: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, prefix: str,
        sliding_window: int | None = None, scale: float | None = None,
        logit_soft_cap: float = 0.0, output_bias: bool = False, attention_chunk: int = 0,
    ) -> None:  # fmt: skip
        """sliding_window: this layer's (None: the model's); scale: of q . k (None:
        head_size^-0.5); logit_soft_cap: scores as cap * tanh(score / cap) (0: none);
        output_bias: o_proj has a bias (gpt-oss's); attention_chunk: queries see only
        their own chunk of that many positions (Llama 4's local layers; 0: none)."""
        super().__init__()
        family = c.family_config(LlamaFamilyConfig)
        parts = self.query_parts
        self.qkv_proj = QKVParallelLinear(
            c.hidden_size, c.head_size, c.num_heads * parts, c.num_kv_heads,
            family.attention_bias, ctx, [f"{prefix}.{p}_proj.weight" for p in "qkv"],
        )  # fmt: skip
        self.num_heads = self.qkv_proj.num_heads_per_partition // parts
        self.num_kv_heads = self.qkv_proj.num_kv_heads_per_partition
        self.head_size = c.head_size
        q_size, self.kv_size, _ = self.qkv_proj.local_sizes
        self.q_size = q_size // parts  # (a rank's queries, without their gates)
        self.o_proj = RowParallelLinear(
            c.num_heads * c.head_size, c.hidden_size, output_bias, ctx, [f"{prefix}.o_proj.weight"]
        )
        self.q_norm = RMSNorm(self.head_size, c.norm_eps) if family.qk_norm else None
        self.k_norm = RMSNorm(self.head_size, c.norm_eps) if family.qk_norm else None
        self.whole_norms = family.qk_norm_whole
        if family.qk_norm and family.qk_norm_whole:  # (this rank's features of each)
            (q_start, _), (k_start, _), _ = self.qkv_proj.shard_offsets
            replicas = max(1, ctx.tp.world_size // c.num_kv_heads)
            self.q_norm = ProjectionRMSNorm(
                self.q_size, c.num_heads * c.head_size, q_start, c.norm_eps, ctx.tp
            )
            self.k_norm = ProjectionRMSNorm(
                self.kv_size, c.num_kv_heads * c.head_size, k_start, c.norm_eps, ctx.tp, replicas
            )
        self.clip = family.clip_qkv
        self.rotary = rotary
        window = c.sliding_window if sliding_window is None else sliding_window
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_size, window, scale, logit_soft_cap,
            attention_chunk,
        )  # fmt: skip
        # A compressed-tensors kv_cache_scheme's per-tensor scales (checkpoint tensors
        # self_attn.k_scale and v_scale), for an int8 or fp8 KV cache.
        self.scales_kind = c.quantization.kv_cache_scales if c.quantization is not None else None
        self.kv_scales = torch.zeros(2) if self.scales_kind is not None else None

    def process_weights_after_loading(self) -> None:
        if self.kv_scales is not None:
            if not bool((self.kv_scales > 0).all()) or not bool(self.kv_scales.isfinite().all()):
                raise ValueError(f"k_scale and v_scale must be finite and positive, got "
                                 f"{self.kv_scales.tolist()}")  # fmt: skip
            self.attn.static_scales(self.scales_kind, *(float(s) for s in self.kv_scales))

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.whole_norms and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.reshape(-1, self.num_heads, self.head_size)
        k = k.reshape(-1, self.num_kv_heads, self.head_size)
        v = v.reshape(-1, self.num_kv_heads, self.head_size)
        if not self.whole_norms and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        self.rotary(positions, q, k)
        out: torch.Tensor = self.o_proj(self.attn(q, k, v, cache, meta).view(-1, self.q_size))
        return out


class MLP(nn.Module):
    # Whether silu(gate) * up is fused into the [gate; up] product (a family whose
    # activation is another takes the product whole).
    fuses_silu = True

    def __init__(self, c: ModelConfig, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        n = c.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            c.hidden_size, [n, n], False, ctx,
            [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"],
            gate_up=self.fuses_silu and not ctx.adapters,
        )  # fmt: skip
        self.down_proj = RowParallelLinear(
            n, c.hidden_size, False, ctx, [f"{prefix}.down_proj.weight"]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.gate_up_proj.silu_and_mul(x))
        return out


class DecoderLayer(nn.Module):
    # Its norms' attribute names, which are also their checkpoint names.
    norms: ClassVar[tuple[str, ...]] = ("input_layernorm", "post_attention_layernorm")

    def __init__(
        self, c: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, prefix: str
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.self_attn = Attention(c, rotary, ctx, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.mlp = MLP(c, ctx, f"{prefix}.mlp")

    def enter(
        self, h: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's normed input and the residual stream: the one before plus its
        output h (the first layer's stream is the embeddings h)."""
        if residual is None:
            return self.input_layernorm(h), h
        self.input_layernorm.add_residual(h, residual)
        return h, residual

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
        h = self.self_attn(h, positions, cache, meta)
        self.post_attention_layernorm.add_residual(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    intermediate_names: tuple[str, ...] = ("hidden", "residual")
    final_norm: ClassVar[str] = "model.norm.weight"  # its checkpoint name
    hf_architectures: ClassVar[tuple[str, ...]] = tuple(_HF_VARIANTS)
    gguf_architectures: ClassVar[tuple[GGUFArchitecture, ...]] = _GGUF_ARCHITECTURES

    @classmethod
    def config_from_hf(cls, raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
        """The family's values from a config.json (Hugging Face's names and defaults)."""
        return _config_from_hf(raw, common)

    def __init__(
        self, config: ModelConfig, max_positions: int, ctx: LayerContext | None = None
    ) -> None:
        super().__init__()
        ctx = ctx or LayerContext()
        self.config = config
        self.placement = ctx.placement
        self.stage = ctx.pp
        rotary = self.make_rotary(config, max_positions)
        # A pipeline stage holds its layers only: the first the embedding, the last the
        # final norm and the head (other layers are placeholders, so indices stay).
        self.start_layer, self.end_layer = self.stage.layer_range(config.num_layers)
        self.embed_tokens = (
            VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, ctx, "model.embed_tokens.weight"
            )
            if self.stage.is_first
            else None
        )
        self.layers = nn.ModuleList(
            [
                self.make_layer(config, rotary, ctx, i)
                if self.start_layer <= i < self.end_layer
                else nn.Identity()
                for i in range(config.num_layers)
            ]
        )
        self.norm = self.make_norm(config.hidden_size) if self.stage.is_last else None
        self.lm_head = stage_lm_head(
            config.vocab_size, config.hidden_size, ctx,
            ("model.embed_tokens.weight", "lm_head.weight"), self.embed_tokens,
            config.tie_word_embeddings,
        )  # fmt: skip
        self.num_parameters = 0

    def make_rotary(self, config: ModelConfig, max_positions: int) -> RotaryEmbedding:
        """The layers' rotary embedding: rotate-half pairs over the head (a family that
        turns other pairs or another size overrides it)."""
        return RotaryEmbedding(
            config.head_size, max_positions, config.rope_theta, config.rope_scaling,
            self.placement.device,
        )  # fmt: skip

    def make_layer(
        self, config: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, index: int
    ) -> nn.Module:
        """Decoder layer `index` (a family with layers of its own overrides it)."""
        return DecoderLayer(config, rotary, ctx, f"model.layers.{index}")

    def make_norm(self, size: int) -> RMSNorm:
        """An RMSNorm of the family's kind (the final one, and the layers' where they ask)."""
        return RMSNorm(size, self.config.norm_eps)

    def route_norm(self, router: WeightRouter, name: str, norm: RMSNorm) -> None:
        """Where a norm's checkpoint weight goes (a family that stores it otherwise, as
        Gemma's 1 + w, overrides it)."""
        router.plain(name, norm.weight)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's hidden states for the tokens (scaled, in families that do)."""
        assert self.embed_tokens is not None, "only the first stage embeds tokens"
        out: torch.Tensor = self.embed_tokens(input_ids)
        return out

    def forward(
        self,
        input_ids: torch.Tensor,  # int [num_tokens]
        positions: torch.Tensor,  # int [num_tokens]
        caches: list[KVCache],  # of this stage's layers
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
        num_layers: int | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Hidden states [num_tokens, hidden] before the final norm; before the last
        pipeline stage, the hidden states and the residual stream for the next stage
        (which passes them as `intermediate`). num_layers: only the stage's first ones
        run (a self-speculative draft), `caches` theirs."""
        residual: torch.Tensor | None = None
        if intermediate is None:
            h = self.embed(input_ids)
        else:
            h, residual = intermediate["hidden"], intermediate["residual"]
        end = self.end_layer if num_layers is None else self.start_layer + num_layers
        for layer, cache in zip(self.layers[self.start_layer : end], caches, strict=True):
            h, residual = layer(h, residual, positions, cache, meta)
        assert residual is not None  # every stage has a layer
        if not self.stage.is_last:
            return {"hidden": h, "residual": residual}
        return stream_sum(residual, h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.norm is not None and self.lm_head is not None, "the last stage's"
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        return logits

    def pooled_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final hidden states as a pooling runner reads them: after the final norm
        (an embedder's, Qwen3-Embedding's last token)."""
        assert self.norm is not None, "the last stage's"
        states: torch.Tensor = self.norm(hidden)
        return states

    def load_weights(
        self,
        weights: Mapping[str, torch.Tensor],
        block_quantized: Mapping[str, BlockQuantized] | None = None,
    ) -> None:
        """Copies Hugging Face-named tensors in (each layer narrows them to its shard),
        q/k/v and gate/up into their fused layers; `block_quantized`: the block form of
        some of them (GGUF's), kept by the layers whose method multiplies from it."""
        router = self.weight_router()
        # A base model's checkpoint (Qwen3-Embedding's, saved without its LM head) names
        # its tensors without the "model." prefix.
        unprefixed = any(name.startswith("layers.") for name in weights)
        with torch.no_grad():
            router.load(weights, block_quantized or {}, _prefixed if unprefixed else None)
        self.prepare_for_inference()

    def prepare_for_inference(self) -> None:
        """After the weights are in: each linear layer's method prepares its weight."""
        self.num_parameters = process_weights_after_loading(self, self.placement)

    def weight_router(self) -> WeightRouter:
        c = self.config
        router = WeightRouter(c.num_layers, "model.layers.", (self.start_layer, self.end_layer))
        self.route_vocab(router, "model.embed_tokens.weight", "lm_head.weight")
        if self.norm is not None:
            self.route_norm(router, self.final_norm, self.norm)
        for i in range(self.start_layer, self.end_layer):
            layer = self.layers[i]
            assert isinstance(layer, DecoderLayer)
            p = f"model.layers.{i}"
            self.route_attention(router, f"{p}.self_attn", layer.self_attn)
            self.route_mlp(router, f"{p}.mlp", layer.mlp)
            for norm_name in layer.norms:
                self.route_norm(router, f"{p}.{norm_name}.weight", getattr(layer, norm_name))
        return router

    def route_vocab(self, router: WeightRouter, embed: str, head: str) -> None:
        """The embeddings' and the LM head's checkpoint names (a tied head loads the
        embeddings)."""
        if self.embed_tokens is not None:
            router.vocab(embed, self.embed_tokens)
        if self.lm_head is not None:
            if not self.config.tie_word_embeddings:
                router.vocab(head, self.lm_head)
            elif self.embed_tokens is None:  # the last stage's tied head loads them itself
                router.vocab(embed, self.lm_head)
        if self.config.tie_word_embeddings:
            router.ignore(head)

    def route_attention(self, router: WeightRouter, prefix: str, attn: nn.Module) -> None:
        """Where a layer's attention weights go (a family with attention of its own, as
        DeepSeek's latent attention, routes its own)."""
        assert isinstance(attn, Attention)
        biases = self.config.family_config(LlamaFamilyConfig).attention_bias
        for part, name in enumerate(("q_proj", "k_proj", "v_proj")):
            router.linear_weight(f"{prefix}.{name}", attn.qkv_proj, part)
            if biases:
                router.linear(f"{prefix}.{name}.bias", attn.qkv_proj, "bias", part)
        self.route_fused(router, prefix, ("q_proj", "k_proj", "v_proj"), "qkv_proj", attn.qkv_proj)
        router.linear_weight(f"{prefix}.o_proj", attn.o_proj)
        if attn.o_proj.bias is not None:
            router.linear(f"{prefix}.o_proj.bias", attn.o_proj, "bias")
        for name, norm in (("q_norm", attn.q_norm), ("k_norm", attn.k_norm)):
            if isinstance(norm, ProjectionRMSNorm):  # (this rank's features)
                weight = norm.weight.data
                router.shard(f"{prefix}.{name}.weight", weight, 0, norm.start, norm.whole)
            elif norm is not None:
                self.route_norm(router, f"{prefix}.{name}.weight", norm)
        if attn.kv_scales is not None:
            router.scalar(f"{prefix}.k_scale", attn.kv_scales[0:1])
            router.scalar(f"{prefix}.v_scale", attn.kv_scales[1:2])

    def route_mlp(self, router: WeightRouter, prefix: str, mlp: nn.Module) -> None:
        """Where a layer's MLP weights go (a mixture of experts routes its own)."""
        assert isinstance(mlp, MLP)
        router.linear_weight(f"{prefix}.gate_proj", mlp.gate_up_proj, part=0)
        router.linear_weight(f"{prefix}.up_proj", mlp.gate_up_proj, part=1)
        router.linear_weight(f"{prefix}.down_proj", mlp.down_proj)
        self.route_fused(router, prefix, ("gate_proj", "up_proj"), "gate_up_proj", mlp.gate_up_proj)

    @staticmethod
    def route_fused(
        router: WeightRouter, module: str, parts: tuple[str, ...], fused: str,
        layer: ColumnParallelLinear,
    ) -> None:  # fmt: skip
        """The stacked parts of a float layer may also come as one tensor (Phi-3's
        qkv_proj and gate_up_proj): whichever form the checkpoint holds."""
        if layer.method.weight_kinds != ("weight",) or layer.method.keeps_blocks:
            return  # (a quantized or block form: the parts' tensors only)
        router.fused(f"{module}.{fused}.weight", layer, "weight")
        router.either([f"{module}.{part}.weight" for part in parts], [f"{module}.{fused}.weight"])


def _prefixed(name: str, tensor: CheckpointTensor) -> tuple[str, CheckpointTensor]:
    """A base model's tensor under the causal LM's name."""
    if name.startswith(("embed_tokens.", "layers.", "norm.")):
        return f"model.{name}", tensor
    return name, tensor
