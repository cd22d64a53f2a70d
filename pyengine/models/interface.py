"""What the model runner needs of a model: the CausalLM protocol."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from pyengine.config import ModelConfig
from pyengine.distributed import IntermediateTensors
from pyengine.layers.attention import AttentionMetadata, KVCache
from pyengine.layers.block_quantized import BlockQuantized
from pyengine.layers.linear import LayerContext
from pyengine.models.checkpoint_config import CommonValues, GGUFArchitecture
from pyengine.models.weights import WeightRouter


class CausalLM(Protocol):
    """A decoder over the paged KV cache. Built with `(config, max_positions, ctx)`:
    its parameters are made at the placement, each linear layer with the LinearMethod
    ctx chooses for it. The class names the architectures it runs and reads their
    configs (models/registry.py finds it by those names)."""

    # The Hugging Face architecture names it runs (a config.json's `architectures`)
    hf_architectures: ClassVar[tuple[str, ...]]
    # The llama.cpp architectures it loads from GGUF files (none: it loads no GGUF)
    gguf_architectures: ClassVar[tuple[GGUFArchitecture, ...]]
    config: ModelConfig
    num_parameters: int  # set once the weights are in (a tied head counted once)
    # [start, end) of the layers this pipeline stage holds (all of them with one stage)
    start_layer: int
    end_layer: int
    # What a stage hands the next (IntermediateTensors' names)
    intermediate_names: tuple[str, ...]

    def __init__(self, config: ModelConfig, max_positions: int, ctx: LayerContext) -> None: ...

    @classmethod
    def config_from_hf(cls, raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
        """The ModelConfig of a config.json's object `raw`, whose architecture is one of
        hf_architectures (common.architecture), with the common values put in; a
        KeyError, TypeError or ValueError for what it cannot run with (the loader names
        the file)."""
        ...

    def __call__(
        self,
        input_ids: torch.Tensor,  # int [num_tokens]
        positions: torch.Tensor,  # int [num_tokens]
        caches: list[KVCache],  # per layer of this stage
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,  # from the previous stage
        num_layers: int | None = None,  # only the stage's first ones, `caches` theirs
    ) -> torch.Tensor | IntermediateTensors:
        """Final hidden states [num_tokens, hidden_size] (before the final norm where
        compute_logits applies it); before the last stage, what the next one takes. With
        num_layers, the hidden states after those layers (a self-speculative draft)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab_size] of hidden states [rows, hidden_size] (the last
        stage's)."""
        ...

    def load_weights(
        self,
        weights: Mapping[str, torch.Tensor],
        block_quantized: Mapping[str, BlockQuantized] | None = None,
    ) -> None:
        """Copies a checkpoint's Hugging Face-named tensors in (block forms by the same
        names), then prepares every layer; ValueError naming a tensor the model has no
        place for, or what the checkpoint lacks."""
        ...

    def weight_router(self) -> WeightRouter:
        """Where each checkpoint tensor (by the names the router takes) goes."""
        ...

    def prepare_for_inference(self) -> None:
        """Prepares the layers for weights already in place (random ones)."""
        ...

    def eval(self) -> CausalLM: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...
