"""The two faces of a quantization method.

A `QuantizationMethod` is a checkpoint format (GPTQ, AWQ, compressed-tensors): it reads
its config.json's `quantization_config` into a QuantizationConfig, refuses what it cannot
run, and gives each linear layer of such a checkpoint its `LinearMethod`. Methods are
found by name in the registry (registry.py).

A `LinearMethod` is how one linear layer holds its weight and multiplies by it. Every
method sees the same life: the layer makes a float weight [out, in] (its shard of the
checkpoint's), the loader copies the checkpoint into it (and hands block-quantized parts,
or a quantized checkpoint's integers and scales, to methods that keep them), then
`process_weights_after_loading` turns it into the method's form, and `apply` multiplies
by it. What a method keeps besides the layer's `weight` parameter it keeps in its own
state object, `layer.method_state`, which only the method reads: the layer knows no form
by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch

from pyengine import ops
from pyengine.config import QuantizationConfig
from pyengine.layers.block_quantized import BlockQuantized
from pyengine.layers.placement import Placement
from pyengine.sampling_params import is_int
from pyengine.utils.lazy_weights import CheckpointTensor

if TYPE_CHECKING:
    from pyengine.layers.linear import LayerContext, LinearBase
    from pyengine.layers.moe.methods import ExpertsMethod

State = TypeVar("State")


def state_of(layer: LinearBase, kind: type[State]) -> State:
    """The layer's method state, which its method made of class `kind`."""
    state = layer.method_state
    assert isinstance(state, kind), f"{type(state).__name__} is not a {kind.__name__}"
    return state


class FusablePanels(NamedTuple):
    """A layer's packed panels as ops.fused_experts takes an expert's, and whether its
    rows go in as int8 (ops.dense's int8_activations)."""

    packed: torch.Tensor
    int8_activations: bool


class LinearMethod(ABC):
    """What a linear layer delegates its weight to. A layer with `gate_up` set holds
    [gate; up] and is applied through `apply_silu_and_mul` only."""

    # The checkpoint tensors of a layer's weight, by the suffix of their names.
    weight_kinds: tuple[str, ...] = ("weight",)
    # Whether the layer takes its weight as GGUF blocks (load_blocks) instead of floats.
    keeps_blocks = False

    def create_weights(self, layer: LinearBase) -> None:
        """Registers layer.weight [out, in] of the layer's shard, for the loader to fill."""
        weight = torch.empty(layer.output_size_per_partition, layer.input_size_per_partition)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)

    def load_quantized(
        self, layer: LinearBase, name: str, kind: str, loaded: CheckpointTensor, part: int
    ) -> None:
        """A quantized checkpoint's tensor of kind `kind` (one of weight_kinds)."""
        raise ValueError(f"weight {name}: this layer holds no {kind!r} tensor")

    def load_blocks(self, layer: LinearBase, start: int, blocks: BlockQuantized) -> None:
        """The block form of rows [start, start + rows) of the weight (GGUF's), handed
        instead of its float values to methods that keep_blocks."""
        raise ValueError(f"{type(self).__name__} takes float weights, not GGUF blocks")

    @abstractmethod
    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Turns the loaded layer.weight into this method's form (may remove it)."""

    @abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [tokens, in] @ weight.T + bias -> [tokens, out]."""

    def apply_silu_and_mul(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T) -> [tokens, out / 2]."""
        product = self.apply(layer, x, None)
        out = torch.empty(x.shape[0], product.shape[1] // 2, dtype=x.dtype, device=x.device)
        ops.silu_and_mul(out, product)
        return out

    def held_tensors(self, layer: LinearBase) -> list[torch.Tensor]:
        """The tensors of the layer's weight that are not its parameters (packed forms,
        integers, scales): what the weight holds in memory besides them."""
        del layer
        return []

    def form(self, layer: LinearBase) -> str | None:
        """The form the weight is held in, in words ("4-bit blocks", "float32 panels"), or
        None where the layer holds none of its own."""
        weight = getattr(layer, "weight", None)
        return str(weight.dtype).removeprefix("torch.") if weight is not None else None

    def panels(self, layer: LinearBase) -> torch.Tensor | None:
        """The packed panels of the weight, for an embedding tied to this layer (a head)
        to look its rows up in; None where the method packs none."""
        del layer
        return None

    def decode_weights(self, layer: LinearBase) -> torch.Tensor | None:
        """The packed form a one-row decode step reads on the CPU: its block form where
        the weight has one, else its panels; None where it packs none (the benchmarks'
        bound of the bytes a decode step streams)."""
        return self.panels(layer)

    def expert_panels(self, layer: LinearBase) -> FusablePanels | None:
        """The packed panels through which ops.fused_experts multiplies a layer that is
        one expert's part as the method's apply would, or None where the method has none
        or changes the rows first (reorders or quantizes them): such experts are
        multiplied one at a time."""
        del layer
        return None

    def share_blocks(self, layer: LinearBase, packed: torch.Tensor) -> None:
        """Takes `packed` (a tied embedding's packed blocks of the same weight) as the
        layer's block form, instead of blocks loaded into it."""
        del layer, packed
        raise ValueError(f"{type(self).__name__} holds no block form to share")


class QuantizationMethod(ABC):
    """A quantized checkpoint format, registered by the `quant_method` name its
    config.json's `quantization_config` gives (registry.py)."""

    @abstractmethod
    def from_hf(self, raw: dict[str, Any]) -> QuantizationConfig:
        """The `quantization_config` object as a QuantizationConfig; ValueError naming what
        the method does not support."""

    def check(self, config: QuantizationConfig) -> None:
        """ValueError where the method cannot run `config` (run once it is read)."""
        del config

    @abstractmethod
    def linear_method(
        self, config: QuantizationConfig, placement: Placement, int8_activations: bool
    ) -> LinearMethod:
        """The method of one linear layer of such a checkpoint (all but the head);
        int8_activations: EngineArgs.quantized_activations is "int8"."""

    def experts_method(self, config: QuantizationConfig, ctx: LayerContext) -> ExpertsMethod | None:
        """The method of a mixture-of-experts layer of such a checkpoint, where the format
        has one of its own; None (every format here): its experts are linear layers of
        linear_method's (layers/moe/linear_experts.py)."""
        del config, ctx
        return None


# The methods whose checkpoints hold float (e4m3) weights.
FLOAT_WEIGHT_METHODS = ("compressed-tensors", "fp8", "mxfp4")


def check_common(config: QuantizationConfig) -> None:
    """The rules every method's QuantizationConfig keeps (ValueError naming the value)."""
    if not is_int(config.group_size) or not (config.group_size == -1 or config.group_size >= 8):
        raise ValueError(
            f"{config.method} group_size must be -1 or at least 8, got {config.group_size!r}"
        )
    if config.weight_type not in ("int", "float"):
        raise ValueError(f"weight_type must be 'int' or 'float', got {config.weight_type!r}")
    if config.block_structure is not None and not (
        config.weight_type == "float"
        and len(config.block_structure) == 2
        and all(is_int(b) and b >= 1 for b in config.block_structure)
    ):
        raise ValueError(
            f"block_structure must be two positive sizes of an FP8 weight's blocks, got "
            f"{config.block_structure!r}"
        )
    group = config.activation_group
    if group and not (is_int(group) and group >= 1):
        raise ValueError(f"activation_group must be positive, got {group!r}")
    if config.weight_type == "float" and config.method not in FLOAT_WEIGHT_METHODS:
        raise ValueError(
            "float weights are compressed-tensors', fp8's (8-bit e4m3) or mxfp4's, "
            f"not {config.method} {config.bits}-bit in groups of {config.group_size}"
        )
