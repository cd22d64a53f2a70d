"""Decoders as classifiers and cross-encoders: LlamaForSequenceClassification and its
Qwen2, Qwen3 and Mistral kin (a reranker fine-tuned from Qwen3, as Qwen3-Reranker's
sequence-classification form). The Llama family's layers and final norm, then `score`, a
linear layer of one row a label, on the prompt's last token; no LM head. A pooling
runner's model (runner "pooling"), never a generator."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from pyengine.config import ModelConfig
from pyengine.layers.linear import LayerContext
from pyengine.models.checkpoint_config import CommonValues, GGUFArchitecture, integer
from pyengine.models.gpt import empty_parameter
from pyengine.models.llama import _HF_VARIANTS, LlamaFamilyConfig, LlamaForCausalLM, _config_from_hf
from pyengine.models.weights import WeightRouter


@dataclass(frozen=True)
class ClassifierFamilyConfig(LlamaFamilyConfig):
    num_labels: int = 2


class LlamaForSequenceClassification(LlamaForCausalLM):
    hf_architectures: ClassVar[tuple[str, ...]] = tuple(
        name.replace("ForCausalLM", "ForSequenceClassification")
        for name in (
            "LlamaForCausalLM",
            "MistralForCausalLM",
            "Qwen2ForCausalLM",
            "Qwen3ForCausalLM",
        )  # fmt: skip
    )
    gguf_architectures: ClassVar[tuple[GGUFArchitecture, ...]] = ()
    has_lm_head: ClassVar[bool] = False
    default_pooling: ClassVar[str] = "last"

    def __init__(
        self, config: ModelConfig, max_positions: int, ctx: LayerContext | None = None
    ) -> None:
        ctx = ctx or LayerContext()
        if ctx.pp.world_size > 1:
            raise ValueError(f"{config.architecture} runs on one pipeline stage")
        super().__init__(config, max_positions, ctx)
        self.lm_head = None  # (the labels' layer instead)
        labels = config.family_config(ClassifierFamilyConfig).num_labels
        self.score = empty_parameter(labels, config.hidden_size)

    @classmethod
    def config_from_hf(cls, raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
        causal = common.architecture.replace("ForSequenceClassification", "ForCausalLM")
        config = _config_from_hf(raw, common, _HF_VARIANTS[causal])
        labels = len(raw.get("id2label") or {}) or integer(raw.get("num_labels", 2))
        family = dataclasses.asdict(config.family_config(LlamaFamilyConfig))
        config.family = ClassifierFamilyConfig(**family, num_labels=labels)
        return config

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{self.config.architecture} is a classifier: it has no LM head")

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """The labels' logits [requests, num_labels] of the pooled (normed) states."""
        return F.linear(pooled, self.score)

    def weight_router(self) -> WeightRouter:
        router = super().weight_router()
        router.plain("score.weight", self.score)
        return router
