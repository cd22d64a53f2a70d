"""The `fp8` quant_method: DeepSeek-V3's checkpoints (and transformers' FineGrainedFP8,
AutoFP8's): e4m3 weights (`weight` float8_e4m3fn [out, in]) with, per block of
`weight_block_size` [out, in] features, a float32 `weight_scale_inv`
[ceil(out / bo), ceil(in / bi)] that multiplies them back (w = e4m3 * scale_inv, despite
its name), the activations quantized to e4m3 per group of bi inputs of a token as each
step runs; or, without blocks, one `weight_scale` per tensor, the activations quantized
per token (dynamic) or by the checkpoint's `input_scale` (static). Held and multiplied by
Fp8Method (fp8_w8a8.py), as compressed-tensors' FP8 is. The embeddings, the head and a
mixture of experts' router stay float, as such checkpoints leave them."""

from __future__ import annotations

from typing import Any

from pyengine.config import QuantizationConfig
from pyengine.layers.placement import Placement
from pyengine.layers.quantization.base import LinearMethod, QuantizationMethod
from pyengine.layers.quantization.fp8_w8a8 import Fp8Method
from pyengine.layers.quantization.registry import register_quantization

# Layers such checkpoints may name as left float: those pyengine never quantizes (the
# head, the embeddings, a mixture of experts' router, `mlp.gate`).
_ALWAYS_FLOAT = ("lm_head", "embed_tokens", "gate")


@register_quantization("fp8")
class Fp8Checkpoint(QuantizationMethod):
    def from_hf(self, raw: dict[str, Any]) -> QuantizationConfig:
        fmt = raw.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 checkpoints in {fmt!r} are not supported (e4m3)")
        scheme = raw.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(
                f"fp8 activation_scheme {scheme!r} is not supported (dynamic or static)"
            )
        float_layers = [
            name for key in ("modules_to_not_convert", "ignored_layers")
            for name in raw.get(key) or []
            if name.rpartition(".")[2] not in _ALWAYS_FLOAT
        ]  # fmt: skip
        if float_layers:
            raise ValueError(
                f"fp8: layers left float ({float_layers[:3]}) are not supported (only "
                f"{', '.join(_ALWAYS_FLOAT)}, which stay float anyway)"
            )
        block = raw.get("weight_block_size")
        if block is None:
            return QuantizationConfig(
                "fp8", 8, -1, activation_bits=8, weight_type="float",
                static_activations=scheme == "static",
            )  # fmt: skip
        if not (isinstance(block, list) and len(block) == 2):
            raise ValueError(f"fp8 weight_block_size must be [out, in], got {block!r}")
        if scheme != "dynamic":
            raise ValueError(
                "fp8 with weight_block_size quantizes activations per group as each step "
                f"runs (activation_scheme 'dynamic'), not {scheme!r}"
            )
        return QuantizationConfig(
            "fp8", 8, -1, activation_bits=8, weight_type="float",
            block_structure=(block[0], block[1]), activation_group=block[1],
        )  # fmt: skip

    def check(self, config: QuantizationConfig) -> None:
        if (config.weight_type, config.bits, config.group_size) != ("float", 8, -1):
            raise ValueError(
                f"fp8 checkpoints hold e4m3 weights, not {config.bits}-bit "
                f"{config.weight_type} ones in groups of {config.group_size}"
            )

    def linear_method(
        self, config: QuantizationConfig, placement: Placement, int8_activations: bool
    ) -> LinearMethod:
        del int8_activations  # (e4m3 activations already)
        scale = "weight_scale_inv" if config.block_structure is not None else "weight_scale"
        return Fp8Method(config, placement, scale_kind=scale)
