"""A loaded checkpoint as a model on its placement: the class from the registry, each
linear layer's method chosen for it, the weights copied in."""

from __future__ import annotations

from dataclasses import replace

import torch

from pyengine.layers.linear import LayerContext
from pyengine.layers.linear_method import LinearMethods
from pyengine.loader.resolve import LoadedModel
from pyengine.models.interface import CausalLM
from pyengine.models.registry import model_class


def build_model(loaded: LoadedModel, max_positions: int, seed: int, ctx: LayerContext) -> CausalLM:
    """The model of `loaded` (random weights of the right scale where it has none)."""
    placement = ctx.placement
    ctx = replace(ctx, methods=LinearMethods(placement, frozenset(loaded.block_quantized)))
    with torch.device(placement.device):  # the parameters are made (and loaded) there
        model = model_class(loaded.config.architecture)(loaded.config, max_positions, ctx)
    if loaded.weights is None:  # load_format="dummy"
        generator = torch.Generator(placement.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    p.normal_(0.0, 0.02, generator=generator)
        model.prepare_for_inference()
    else:
        model.load_weights(loaded.weights, loaded.block_quantized)
    return model.eval()
