"""GPTQ checkpoints (AutoGPTQ, GPTQModel): 4- or 8-bit integer weights in groups of
input features, in the checkpoint's order or in activation order (desc_act), held and
multiplied by WeightOnlyIntMethod (weight_only_int.py, which reads their layout)."""

from __future__ import annotations

from typing import Any

from pyengine.config import QuantizationConfig
from pyengine.layers.placement import Placement
from pyengine.layers.quantization.base import LinearMethod, QuantizationMethod
from pyengine.layers.quantization.registry import register_quantization
from pyengine.layers.quantization.weight_only_int import WeightOnlyIntMethod, check_int_bits


@register_quantization("gptq")
class GPTQ(QuantizationMethod):
    def from_hf(self, raw: dict[str, Any]) -> QuantizationConfig:
        # Checked by check (a missing or odd value is named there).
        bits: Any = raw.get("bits", raw.get("w_bit"))
        group_size: Any = raw.get("group_size", raw.get("q_group_size"))
        checkpoint_format = raw.get("checkpoint_format", "gptq")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq checkpoint_format {checkpoint_format!r} is not supported")
        return QuantizationConfig(
            "gptq", bits, group_size, bool(raw.get("desc_act", False)),
            zero_offset=1 if checkpoint_format == "gptq" else 0,
        )  # fmt: skip

    def check(self, config: QuantizationConfig) -> None:
        check_int_bits(config, (4, 8))

    def linear_method(
        self, config: QuantizationConfig, placement: Placement, int8_activations: bool
    ) -> LinearMethod:
        return WeightOnlyIntMethod(config, placement, int8_activations)
