"""A loaded checkpoint as a model on its placement: the class from the registry, each
linear layer's method chosen for it, the weights copied in."""

from __future__ import annotations

import functools
import zlib
from dataclasses import replace

import torch

from pyengine.layers.linear import LayerContext
from pyengine.layers.quantization.choose import LinearMethods
from pyengine.loader.resolve import LoadedModel
from pyengine.models.interface import CausalLM
from pyengine.models.registry import model_class
from pyengine.utils.lazy_weights import LazyWeights


def dummy_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> LazyWeights:
    """Random weights of the right scale, each whole tensor drawn from its name and the
    seed: every rank narrows the same tensor, so the model is the same however split."""

    def draw(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if "norm" in name:
            return torch.full(shape, 1.0 if name.endswith("weight") else 0.0)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.empty(shape).normal_(0.0, 0.02, generator=generator)

    return LazyWeights(
        {name: functools.partial(draw, name, shape) for name, shape in shapes.items()}
    )


def build_model(loaded: LoadedModel, max_positions: int, seed: int, ctx: LayerContext) -> CausalLM:
    """The model of `loaded` (random weights of the right scale where it has none)."""
    if not loaded.weights_read:
        raise ValueError(f"{loaded.source}: loaded without its weights (read_weights=False)")
    placement = ctx.placement
    methods = LinearMethods(
        placement, frozenset(loaded.block_quantized), loaded.config.quantization,
        ctx.quantized_activations, ctx.prompts_only,
    )  # fmt: skip
    ctx = replace(ctx, methods=methods)
    with torch.device(placement.device):  # the parameters are made (and loaded) there
        model = model_class(loaded.config.architecture)(loaded.config, max_positions, ctx)
    if loaded.weights is None:  # load_format="dummy"
        router = model.weight_router()
        with torch.no_grad():
            router.load(dummy_weights(router.shapes(), seed), {})
        model.prepare_for_inference()
    else:
        model.load_weights(loaded.weights, loaded.block_quantized)
    return model.eval()
