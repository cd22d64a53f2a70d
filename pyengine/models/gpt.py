"""Decoders with learned absolute positions, LayerNorm and biases everywhere: OPT and
GPT-2, each a subclass that reads its own config.json and names its own checkpoint
tensors. Same flat batch and paged attention as the Llama family; no rotary embedding."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pyengine.config import NO_CACHE_SPEC, FamilyConfig, ModelConfig
from pyengine.distributed import IntermediateTensors
from pyengine.layers.attention import AttentionMetadata, KVCache, PagedAttention
from pyengine.layers.block_quantized import BlockQuantized
from pyengine.layers.encoder_attention import EncoderAttention
from pyengine.layers.linear import (
    ColumnParallelLinear,
    LayerContext,
    QKVParallelLinear,
    RowParallelLinear,
    process_weights_after_loading,
)
from pyengine.layers.vocab_embedding import VocabParallelEmbedding, stage_lm_head
from pyengine.models.checkpoint_config import (
    CommonValues,
    GGUFArchitecture,
    head_size_of,
    integer,
)
from pyengine.models.weights import WeightRouter
from pyengine.utils.lazy_weights import CheckpointTensor

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True)
class LearnedPositionConfig(FamilyConfig):
    """Where OPT, GPT-2 and the encoders (models/bert.py) differ in their layers."""

    norm_before: bool = True  # pre-LN (else post-LN, as OPT-350m and BERT)
    position_offset: int = 0  # OPT's (and RoBERTa's) learned positions start at row 2
    bidirectional: bool = False  # an encoder's: its layers attend both ways, cache nothing

    def kv_spec(self, index: int, sliding_window: int) -> tuple[str, int]:
        return NO_CACHE_SPEC if self.bidirectional else super().kv_spec(index, sliding_window)


def empty_parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class BiasedLayerNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = empty_parameter(size)
        self.bias = empty_parameter(size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class TransformerLayer(nn.Module):
    def __init__(self, c: ModelConfig, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        hidden = c.hidden_size
        self.norm1 = BiasedLayerNorm(hidden, c.norm_eps)
        self.qkv = QKVParallelLinear(
            hidden, c.head_size, c.num_heads, c.num_heads, True, ctx, [f"{prefix}.qkv"]
        )
        self.num_heads, self.head_size = self.qkv.num_heads_per_partition, c.head_size
        self.out = RowParallelLinear(hidden, hidden, True, ctx, [f"{prefix}.out"])
        self.norm2 = BiasedLayerNorm(hidden, c.norm_eps)
        self.fc1 = ColumnParallelLinear(hidden, [c.intermediate_size], True, ctx, [f"{prefix}.fc1"])
        self.fc2 = RowParallelLinear(c.intermediate_size, hidden, True, ctx, [f"{prefix}.fc2"])
        if c.hidden_act not in ACTIVATIONS:
            raise ValueError(f"activation {c.hidden_act!r} is not supported")
        self.act = ACTIVATIONS[c.hidden_act]
        family = c.family_config(LearnedPositionConfig)
        self.norm_before = family.norm_before
        self.attn: PagedAttention | EncoderAttention = (
            EncoderAttention(self.num_heads, c.head_size) if family.bidirectional
            else PagedAttention(self.num_heads, self.num_heads, c.head_size)
        )  # fmt: skip

    def _attention(self, x: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv(x).view(-1, 3, self.num_heads, self.head_size).unbind(1)
        attended = self.attn(q, k, v, cache, meta).view(-1, self.num_heads * self.head_size)
        out: torch.Tensor = self.out(attended)
        return out

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.act(self.fc1(x)))
        return out

    def forward(self, h: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        if self.norm_before:
            h = h + self._attention(self.norm1(h), cache, meta)
            return h + self._mlp(self.norm2(h))
        h = self.norm1(h + self._attention(h, cache, meta))
        out: torch.Tensor = self.norm2(h + self._mlp(h))
        return out


@dataclass(frozen=True)
class CheckpointNames:
    """How an architecture's checkpoint names its tensors, against the internal names
    that the router takes."""

    prefixes: tuple[str, ...]  # taken off every name, in this order
    # Modules outside the layers (prefixes taken off), and what loads them
    outside: Mapping[str, str]
    # A layer's module, and the internal module with its part of the fused q/k/v (None:
    # the whole of it)
    layer: Mapping[str, tuple[str, int | None]]
    conv1d: tuple[str, ...] = ()  # layer modules whose weights are stored [in, out]

    @property
    def split_qkv(self) -> bool:
        """Whether q, k and v come as three tensors (OPT), not one (GPT-2)."""
        return any(part is not None for _, part in self.layer.values())


_OPT_GLOBAL = {"embed_tokens": "embed_tokens", "embed_positions": "embed_positions",
               "final_layer_norm": "final_norm", "lm_head": "lm_head"}  # fmt: skip
_GPT2_GLOBAL = {"wte": "embed_tokens", "wpe": "embed_positions", "ln_f": "final_norm",
                "lm_head": "lm_head"}  # fmt: skip
_OPT_LAYER = {
    "self_attn.q_proj": ("qkv", 0),
    "self_attn.k_proj": ("qkv", 1),
    "self_attn.v_proj": ("qkv", 2),
    "self_attn.out_proj": ("out", None),
    "self_attn_layer_norm": ("norm1", None),
    "final_layer_norm": ("norm2", None),
    "fc1": ("fc1", None),
    "fc2": ("fc2", None),
}
_GPT2_LAYER = {
    "ln_1": ("norm1", None),
    "attn.c_attn": ("qkv", None),  # q, k and v in one tensor
    "attn.c_proj": ("out", None),
    "ln_2": ("norm2", None),
    "mlp.c_fc": ("fc1", None),
    "mlp.c_proj": ("fc2", None),
}
_GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class LearnedPositionDecoder(nn.Module):
    """What OPT and GPT-2 share; each subclass says which architecture it runs, reads its
    config and names its checkpoint's tensors (`checkpoint_names`)."""

    intermediate_names: tuple[str, ...] = ("hidden",)
    gguf_architectures: ClassVar[tuple[GGUFArchitecture, ...]] = ()  # none from GGUF
    checkpoint_names: ClassVar[CheckpointNames]
    has_lm_head: ClassVar[bool] = True  # (an encoder has none)

    def __init__(self, config: ModelConfig, max_positions: int, ctx: LayerContext | None = None):
        super().__init__()
        ctx = ctx or LayerContext()
        self.config = config
        self.placement = ctx.placement
        c = config
        if c.quantization is not None:
            raise ValueError(
                f"{c.quantization.method} checkpoints of {c.architecture} are not supported "
                "(the Llama family's are)"
            )
        # A pipeline stage holds its layers only (placeholders for the others): the
        # first the embeddings, the last the final norm and the head.
        self.stage = ctx.pp
        self.start_layer, self.end_layer = self.stage.layer_range(c.num_layers)
        first, last = self.stage.is_first, self.stage.is_last
        self.embed_tokens = (
            VocabParallelEmbedding(c.vocab_size, c.hidden_size, ctx) if first else None
        )
        self.position_offset = c.family_config(LearnedPositionConfig).position_offset
        self.embed_positions = (
            empty_parameter(c.max_position_embeddings + self.position_offset, c.hidden_size)
            if first
            else None
        )
        self.layers = nn.ModuleList(
            [
                TransformerLayer(c, ctx, f"layers.{i}")
                if self.start_layer <= i < self.end_layer
                else nn.Identity()
                for i in range(c.num_layers)
            ]
        )
        # OPT-350m (post-LN) has no final norm; every pre-LN model has one.
        norm_before = c.family_config(LearnedPositionConfig).norm_before
        self.final_norm = (
            BiasedLayerNorm(c.hidden_size, c.norm_eps) if norm_before and last else None
        )
        self.lm_head = stage_lm_head(
            c.vocab_size, c.hidden_size, ctx, ("embed_tokens", "lm_head"), self.embed_tokens,
            c.tie_word_embeddings,
        ) if self.has_lm_head else None  # fmt: skip
        self.num_parameters = 0

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[KVCache],  # of this stage's layers
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
        num_layers: int | None = None,  # only the first ones (a self-speculative draft)
    ) -> torch.Tensor | IntermediateTensors:
        if intermediate is None:
            assert self.embed_tokens is not None and self.embed_positions is not None
            h: torch.Tensor = self.embed_tokens(input_ids) + F.embedding(
                positions + self.position_offset, self.embed_positions
            )
        else:
            h = intermediate["hidden"]
        end = self.end_layer if num_layers is None else self.start_layer + num_layers
        for layer, cache in zip(self.layers[self.start_layer : end], caches, strict=True):
            h = layer(h, cache, meta)
        return h if self.stage.is_last else {"hidden": h}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "the last stage's"
        logits: torch.Tensor = self.lm_head(self.pooled_states(hidden))
        return logits

    def pooled_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final hidden states as a pooling runner reads them: after the final norm."""
        return hidden if self.final_norm is None else self.final_norm(hidden)

    def load_weights(
        self,
        weights: Mapping[str, torch.Tensor],
        block_quantized: Mapping[str, BlockQuantized] | None = None,
    ) -> None:
        with torch.no_grad():
            self.weight_router().load(weights, block_quantized or {}, self._normalize)
        self.prepare_for_inference()

    def prepare_for_inference(self) -> None:
        """After the weights are in: each linear layer's method prepares its weight."""
        self.num_parameters = process_weights_after_loading(self, self.placement)

    def weight_router(self) -> WeightRouter:
        """Routes by internal names (_normalize maps the checkpoint's to them)."""
        layer_range = (self.start_layer, self.end_layer)
        router = WeightRouter(self.config.num_layers, "layers.", layer_range)
        tied = self.config.tie_word_embeddings
        if self.embed_tokens is not None and self.embed_positions is not None:
            router.vocab("embed_tokens.weight", self.embed_tokens)
            router.plain("embed_positions.weight", self.embed_positions)
        if self.lm_head is not None and not (tied and self.embed_tokens is not None):
            # Untied, or a tied head on a stage without the embeddings: it loads them.
            router.vocab("embed_tokens.weight" if tied else "lm_head.weight", self.lm_head)
        if tied:
            router.ignore("lm_head.weight")
        if self.final_norm is not None:
            router.plain("final_norm.weight", self.final_norm.weight)
            router.plain("final_norm.bias", self.final_norm.bias)
        split_qkv = self.checkpoint_names.split_qkv
        for i in range(self.start_layer, self.end_layer):
            layer = self.layers[i]
            assert isinstance(layer, TransformerLayer)
            p = f"layers.{i}"
            for norm in ("norm1", "norm2"):
                for kind in ("weight", "bias"):
                    router.plain(f"{p}.{norm}.{kind}", getattr(getattr(layer, norm), kind))
            for kind in ("weight", "bias"):
                if split_qkv:
                    for part in range(3):
                        router.linear(f"{p}.qkv.{part}.{kind}", layer.qkv, kind, part)
                else:
                    router.fused(f"{p}.qkv.{kind}", layer.qkv, kind)
                for name in ("out", "fc1", "fc2"):
                    router.linear(f"{p}.{name}.{kind}", getattr(layer, name), kind)
        return router

    def _normalize(
        self, name: str, tensor: CheckpointTensor
    ) -> tuple[str, CheckpointTensor] | None:
        """A checkpoint name as the router's (None: not a weight, as GPT-2's attn.bias
        buffers); GPT-2's Conv1D weights transposed to [out, in]."""
        names = self.checkpoint_names
        for prefix in names.prefixes:
            name = name.removeprefix(prefix)
        module, _, kind = name.rpartition(".")
        if module in names.outside:
            return f"{names.outside[module]}.{kind}", tensor
        m = re.fullmatch(r"(?:layers|layer|h)\.(\d+)\.(.+)", module)
        if not m:
            return None
        if m.group(2) not in names.layer:
            # A layer the model lacks is an error; other tensors are old buffers.
            return (f"layers.{m.group(1)}.{m.group(2)}.{kind}", tensor)
        internal, part = names.layer[m.group(2)]
        if m.group(2) in names.conv1d and kind == "weight":
            tensor = tensor.t()
        suffix = "" if part is None else f".{part}"
        return f"layers.{m.group(1)}.{internal}{suffix}.{kind}", tensor


class OPTForCausalLM(LearnedPositionDecoder):
    hf_architectures: ClassVar[tuple[str, ...]] = ("OPTForCausalLM",)
    checkpoint_names: ClassVar[CheckpointNames] = CheckpointNames(
        ("model.", "decoder."), _OPT_GLOBAL, _OPT_LAYER
    )

    @classmethod
    def config_from_hf(cls, raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
        """OPT's config.json (transformers' OPTConfig names and defaults)."""
        hidden, heads = integer(raw["hidden_size"]), integer(raw["num_attention_heads"])
        if integer(raw.get("word_embed_proj_dim") or hidden) != hidden:
            raise ValueError("OPT models with word_embed_proj_dim != hidden_size are not supported")
        return ModelConfig(
            architecture=common.architecture,
            vocab_size=integer(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=integer(raw["ffn_dim"]),
            num_layers=integer(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=heads,
            head_size=head_size_of(hidden, heads),
            max_position_embeddings=integer(raw.get("max_position_embeddings", 2048)),
            norm_eps=1e-5,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            bos_token_id=common.bos_token_id,
            eos_token_ids=common.eos_token_ids,
            hidden_act=str(raw.get("activation_function", "relu")),
            family=LearnedPositionConfig(
                norm_before=bool(raw.get("do_layer_norm_before", True)), position_offset=2
            ),
        )


class GPT2ForCausalLM(LearnedPositionDecoder):
    hf_architectures: ClassVar[tuple[str, ...]] = ("GPT2LMHeadModel",)
    checkpoint_names: ClassVar[CheckpointNames] = CheckpointNames(
        ("transformer.",), _GPT2_GLOBAL, _GPT2_LAYER, conv1d=_GPT2_CONV1D
    )

    @classmethod
    def config_from_hf(cls, raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
        """GPT-2's config.json (transformers' GPT2Config names and defaults)."""
        hidden, heads = integer(raw["n_embd"]), integer(raw["n_head"])
        if raw.get("scale_attn_by_inverse_layer_idx") or not raw.get("scale_attn_weights", True):
            raise ValueError("GPT-2 variants with other attention scaling are not supported")
        return ModelConfig(
            architecture=common.architecture,
            vocab_size=integer(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=integer(raw.get("n_inner") or 4 * hidden),
            num_layers=integer(raw["n_layer"]),
            num_heads=heads,
            num_kv_heads=heads,
            head_size=head_size_of(hidden, heads),
            max_position_embeddings=integer(raw.get("n_positions", 1024)),
            norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            bos_token_id=common.bos_token_id,
            eos_token_ids=common.eos_token_ids,
            hidden_act=str(raw.get("activation_function", "gelu_new")),
            family=LearnedPositionConfig(norm_before=True, position_offset=0),
        )
