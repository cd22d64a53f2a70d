"""AWQ checkpoints (AutoAWQ's GEMM format): 4-bit integer weights in groups of input
features with zero points, held and multiplied by WeightOnlyIntMethod (weight_only_int.py,
which reads their layout)."""

from __future__ import annotations

from typing import Any

from pyengine.config import QuantizationConfig
from pyengine.layers.placement import Placement
from pyengine.layers.quantization.base import LinearMethod, QuantizationMethod
from pyengine.layers.quantization.registry import register_quantization
from pyengine.layers.quantization.weight_only_int import WeightOnlyIntMethod, check_int_bits


@register_quantization("awq")
class AWQ(QuantizationMethod):
    def from_hf(self, raw: dict[str, Any]) -> QuantizationConfig:
        # Checked by check (a missing or odd value is named there).
        bits: Any = raw.get("bits", raw.get("w_bit"))
        group_size: Any = raw.get("group_size", raw.get("q_group_size"))
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm" or raw.get("zero_point") is False:
            raise ValueError(
                f"awq version {version!r} (zero_point {raw.get('zero_point')!r}) is not "
                "supported: AutoAWQ's GEMM packing with zero points"
            )
        return QuantizationConfig("awq", bits, group_size)

    def check(self, config: QuantizationConfig) -> None:
        check_int_bits(config, (4,))
        if config.desc_act:
            raise ValueError("awq checkpoints have no activation-order groups (desc_act)")

    def linear_method(
        self, config: QuantizationConfig, placement: Placement, int8_activations: bool
    ) -> LinearMethod:
        return WeightOnlyIntMethod(config, placement, int8_activations)
