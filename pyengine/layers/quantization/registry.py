"""Quantization methods by name: the `quant_method` of a checkpoint's
`quantization_config`, and EngineArgs.quantization.

Each method is one module that registers its QuantizationMethod with
`@register_quantization(name)`; the table below names the module, which is imported the
first time its method is asked for (so that this module imports none of them, and a
method module may import what it likes of the package). Adding a method is its module
and one line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from pyengine.config import QuantizationConfig
from pyengine.layers.quantization.base import QuantizationMethod, check_common

_PACKAGE = "pyengine.layers.quantization"
# name -> the module that registers it
_MODULES = {
    "gptq": f"{_PACKAGE}.gptq",
    "awq": f"{_PACKAGE}.awq",
    "compressed-tensors": f"{_PACKAGE}.compressed_tensors",
    "fp8": f"{_PACKAGE}.fp8",
    "mxfp4": f"{_PACKAGE}.mxfp4",
}
QUANTIZATION_METHODS = tuple(_MODULES)

_REGISTERED: dict[str, QuantizationMethod] = {}

Method = type[QuantizationMethod]


def register_quantization(name: str) -> Callable[[Method], Method]:
    """A class decorator: the method `name` is an instance of the class."""

    def register(cls: Method) -> Method:
        if name in _REGISTERED:
            raise ValueError(f"quantization method {name!r} is registered twice")
        _REGISTERED[name] = cls()
        return cls

    return register


def quantization_method(name: str) -> QuantizationMethod:
    """The method registered as `name` (its module imported on first use)."""
    if name not in _REGISTERED:
        if name not in _MODULES:
            raise ValueError(
                f"quantization {name!r} is not supported (supported: "
                f"{', '.join(QUANTIZATION_METHODS)})"
            )
        importlib.import_module(_MODULES[name])
    return _REGISTERED[name]


def quantization_from_hf(raw: Any) -> QuantizationConfig:
    """A config.json's `quantization_config`, read by the method its `quant_method` names
    and checked by it; ValueError naming what is not supported."""
    method = raw.get("quant_method") if isinstance(raw, dict) else None
    if method not in _MODULES:
        raise ValueError(
            f"quantized checkpoints ({method or 'quantization_config'}) are not supported "
            f"(supported: {', '.join(QUANTIZATION_METHODS)}); give float weights, or a GGUF file"
        )
    assert isinstance(raw, dict) and isinstance(method, str)
    quantization = quantization_method(method)
    config = quantization.from_hf(raw)
    check_quantization_config(config)
    return config


def check_quantization_config(config: QuantizationConfig) -> None:
    """ValueError where `config` is not one its method can run."""
    quantization = quantization_method(config.method)
    check_common(config)
    quantization.check(config)
