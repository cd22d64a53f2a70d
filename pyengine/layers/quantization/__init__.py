"""How linear layers hold their weights: one module per method, a registry of the
quantized checkpoint formats by name (registry.py), and the choice of each layer's method
(choose.py). docs/architecture.md, "Linear layers and quantization", tells how to add one.
"""

from pyengine.layers.quantization.base import LinearMethod, QuantizationMethod
from pyengine.layers.quantization.choose import LinearMethods
from pyengine.layers.quantization.registry import (
    QUANTIZATION_METHODS,
    quantization_from_hf,
    quantization_method,
    register_quantization,
)

__all__ = [
    "QUANTIZATION_METHODS",
    "LinearMethod",
    "LinearMethods",
    "QuantizationMethod",
    "quantization_from_hf",
    "quantization_method",
    "register_quantization",
]
