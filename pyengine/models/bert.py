"""BERT-family encoders: BertModel, RobertaModel and XLMRobertaModel (embedders, pooled
by [CLS] or by the mean of their tokens), and their cross-encoders and classifiers
(...ForSequenceClassification). They share OPT's and GPT-2's layers (models/gpt.py)
post-LN, with bidirectional attention over each request's own tokens
(layers/encoder_attention.py) and no KV cache; a prompt runs whole, in one step of the
pooling runner.

Their embeddings add a token type (a text pair's second text is type 1; the engine
carries it in the token ids, pooling_params.TOKEN_TYPE_SHIFT) and a LayerNorm. RoBERTa's
positions start after its padding id (row padding_idx + 1), as OPT's start at row 2."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from pyengine.config import ModelConfig
from pyengine.distributed import IntermediateTensors
from pyengine.layers.attention import AttentionMetadata, KVCache
from pyengine.layers.linear import LayerContext
from pyengine.models.checkpoint_config import CommonValues, head_size_of, integer
from pyengine.models.gpt import (
    BiasedLayerNorm,
    CheckpointNames,
    LearnedPositionConfig,
    LearnedPositionDecoder,
    empty_parameter,
)
from pyengine.models.weights import WeightRouter
from pyengine.pooling_params import without_token_types


@dataclass(frozen=True)
class EncoderConfig(LearnedPositionConfig):
    """An encoder's own values besides its layers'."""

    type_vocab_size: int = 2
    num_labels: int = 0  # a classifier's (0: an embedder, which has no head)


_LAYER = {
    "attention.self.query": ("qkv", 0),
    "attention.self.key": ("qkv", 1),
    "attention.self.value": ("qkv", 2),
    "attention.output.dense": ("out", None),
    "attention.output.LayerNorm": ("norm1", None),
    "intermediate.dense": ("fc1", None),
    "output.dense": ("fc2", None),
    "output.LayerNorm": ("norm2", None),
}
_EMBEDDINGS = {
    "embeddings.word_embeddings": "embed_tokens",
    "embeddings.position_embeddings": "embed_positions",
    "embeddings.token_type_embeddings": "embed_types",
    "embeddings.LayerNorm": "embed_norm",
}
# Every encoder's layers are under "encoder." (a task model's under its base's prefix too);
# the classifier's head is a dense layer, tanh, and the labels' layer: BERT's pooler and
# classifier, RoBERTa's classifier.dense and classifier.out_proj.
_PREFIXES = ("bert.", "roberta.", "encoder.")
_BERT_HEAD = {"pooler.dense": "head_dense", "classifier": "head_out"}
_ROBERTA_HEAD = {"classifier.dense": "head_dense", "classifier.out_proj": "head_out"}


class BertEncoder(LearnedPositionDecoder):
    """An encoder: a pooling runner's model (runner "pooling"), never a generator."""

    hf_architectures: ClassVar[tuple[str, ...]] = ("BertModel", "BertForSequenceClassification")
    checkpoint_names: ClassVar[CheckpointNames] = CheckpointNames(
        _PREFIXES, {**_EMBEDDINGS, **_BERT_HEAD}, _LAYER
    )
    has_lm_head: ClassVar[bool] = False
    default_pooling: ClassVar[str] = "cls"
    padded_positions: ClassVar[bool] = False  # RoBERTa's positions start after padding

    def __init__(self, config: ModelConfig, max_positions: int, ctx: LayerContext | None = None):
        ctx = ctx or LayerContext()
        if ctx.pp.world_size > 1:
            raise ValueError(f"{config.architecture} runs on one pipeline stage")
        super().__init__(config, max_positions, ctx)
        c, family = config, config.family_config(EncoderConfig)
        self.embed_types = empty_parameter(family.type_vocab_size, c.hidden_size)
        self.embed_norm = BiasedLayerNorm(c.hidden_size, c.norm_eps)
        self.num_labels = family.num_labels
        if self.num_labels:
            self.head_dense = BiasedLinear(c.hidden_size, c.hidden_size)
            self.head_out = BiasedLinear(c.hidden_size, self.num_labels)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[KVCache],
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
        num_layers: int | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        assert self.embed_tokens is not None and self.embed_positions is not None
        ids, types = without_token_types(input_ids.long())
        h: torch.Tensor = (
            self.embed_tokens(ids)
            + F.embedding(positions.long() + self.position_offset, self.embed_positions)
            + F.embedding(types, self.embed_types)
        )
        h = self.embed_norm(h)
        for layer, cache in zip(self.layers, caches, strict=True):
            h = layer(h, cache, meta)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{self.config.architecture} is an encoder: it has no LM head")

    def pooled_states(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # (post-LN: every layer ends in its norm)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """The labels' logits [requests, num_labels] of the pooled [CLS] states."""
        if not self.num_labels:
            raise ValueError(f"{self.config.architecture} has no classifier head")
        logits: torch.Tensor = self.head_out(torch.tanh(self.head_dense(pooled)))
        return logits

    def weight_router(self) -> WeightRouter:
        router = super().weight_router()
        router.plain("embed_types.weight", self.embed_types)
        for kind in ("weight", "bias"):
            router.plain(f"embed_norm.{kind}", getattr(self.embed_norm, kind))
            for name in ("head_dense", "head_out"):
                if self.num_labels:
                    router.plain(f"{name}.{kind}", getattr(getattr(self, name), kind))
                else:  # (an embedder's checkpoint may hold BERT's pooler, unused)
                    router.ignore(f"{name}.{kind}")
        return router

    @classmethod
    def config_from_hf(cls, raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
        """BERT's, RoBERTa's and XLM-R's config.json (transformers' names and defaults)."""
        hidden, heads = integer(raw["hidden_size"]), integer(raw["num_attention_heads"])
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"position_embedding_type {raw['position_embedding_type']!r} is not supported"
            )
        offset = integer(raw.get("pad_token_id", 1)) + 1 if cls.padded_positions else 0
        positions = integer(raw.get("max_position_embeddings", 512)) - offset
        labels = 0
        if common.architecture.endswith("ForSequenceClassification"):
            labels = len(raw.get("id2label") or {}) or integer(raw.get("num_labels", 2))
        return ModelConfig(
            architecture=common.architecture,
            vocab_size=integer(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=integer(raw["intermediate_size"]),
            num_layers=integer(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=heads,
            head_size=head_size_of(hidden, heads),
            max_position_embeddings=positions,
            norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            tie_word_embeddings=False,
            bos_token_id=common.bos_token_id,
            eos_token_ids=common.eos_token_ids,
            hidden_act=str(raw.get("hidden_act", "gelu")),
            family=EncoderConfig(
                norm_before=False, position_offset=offset, bidirectional=True,
                type_vocab_size=integer(raw.get("type_vocab_size", 2)), num_labels=labels,
            ),
        )  # fmt: skip


class RobertaEncoder(BertEncoder):
    hf_architectures: ClassVar[tuple[str, ...]] = (
        "RobertaModel", "XLMRobertaModel", "RobertaForSequenceClassification",
        "XLMRobertaForSequenceClassification",
    )  # fmt: skip
    checkpoint_names: ClassVar[CheckpointNames] = CheckpointNames(
        _PREFIXES, {**_EMBEDDINGS, **_ROBERTA_HEAD, "pooler.dense": "pooler"}, _LAYER
    )
    padded_positions: ClassVar[bool] = True

    def weight_router(self) -> WeightRouter:
        router = super().weight_router()
        for kind in ("weight", "bias"):  # (the base model's pooler, which no head reads)
            router.ignore(f"pooler.{kind}")
        return router


class BiasedLinear(torch.nn.Module):
    """A small linear layer, whole on every rank (a classifier's head)."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.weight = empty_parameter(outputs, inputs)
        self.bias = empty_parameter(outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
