"""The registry of quantization methods (layers/quantization/registry.py): every name it
lists is a registered method, a method reads and checks its own quantization_config, and
what is not registered is refused by name."""

from __future__ import annotations

import pytest

from pyengine.config import QuantizationConfig
from pyengine.layers.placement import Placement
from pyengine.layers.quantization import (
    QUANTIZATION_METHODS,
    QuantizationMethod,
    quantization_from_hf,
    quantization_method,
    register_quantization,
)
from pyengine.layers.quantization.fp8_w8a8 import Fp8Method
from pyengine.layers.quantization.int8_w8a8 import Int8W8A8Method
from pyengine.layers.quantization.registry import check_quantization_config
from pyengine.layers.quantization.weight_only_int import WeightOnlyIntMethod


def test_every_listed_name_is_a_registered_method() -> None:
    assert QUANTIZATION_METHODS == ("gptq", "awq", "compressed-tensors", "fp8", "mxfp4")
    for name in QUANTIZATION_METHODS:
        assert isinstance(quantization_method(name), QuantizationMethod)


def test_an_unknown_name_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"quantization 'bitsandbytes' is not supported"):
        quantization_method("bitsandbytes")
    with pytest.raises(ValueError, match=r"quantized checkpoints \(bitsandbytes\) are not"):
        quantization_from_hf({"quant_method": "bitsandbytes"})


def test_a_name_registers_once() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        register_quantization("gptq")(type(quantization_method("gptq")))


def test_each_method_reads_and_checks_its_config() -> None:
    gptq = quantization_from_hf({"quant_method": "gptq", "bits": 8, "group_size": 32})
    assert (gptq.method, gptq.bits, gptq.group_size, gptq.zero_offset) == ("gptq", 8, 32, 1)
    with pytest.raises(ValueError, match=r"awq with 8-bit weights is not supported"):
        quantization_from_hf({"quant_method": "awq", "bits": 8, "group_size": 32})
    with pytest.raises(ValueError, match=r"gptq group_size must be -1 or at least 8"):
        quantization_from_hf({"quant_method": "gptq", "bits": 4, "group_size": 4})
    with pytest.raises(ValueError, match="float weights are compressed-tensors', fp8's"):
        check_quantization_config(QuantizationConfig("gptq", 8, -1, weight_type="float"))


def test_a_compressed_tensors_scheme_picks_its_layers_method() -> None:
    method = quantization_method("compressed-tensors")
    placement = Placement()
    cases = [
        (QuantizationConfig("compressed-tensors", 8, -1, activation_bits=8), Int8W8A8Method),
        (QuantizationConfig("compressed-tensors", 8, -1, weight_type="float"), Fp8Method),
        (QuantizationConfig("compressed-tensors", 4, 32), WeightOnlyIntMethod),
    ]
    for config, kind in cases:
        check_quantization_config(config)
        assert isinstance(method.linear_method(config, placement, False), kind)


def test_the_fp8_quant_method_reads_deepseek_v3s_blocks_and_per_tensor_scales() -> None:
    """DeepSeek-V3's form: weight_scale_inv per block, activations per group of the block's
    inputs; AutoFP8's: one weight_scale a tensor, activations per token or static."""
    blocks = quantization_from_hf({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
                                   "dynamic", "weight_block_size": [128, 128]})  # fmt: skip
    assert (blocks.block_structure, blocks.activation_group) == ((128, 128), 128)
    method = quantization_method("fp8").linear_method(blocks, Placement(), False)
    assert isinstance(method, Fp8Method) and method.weight_kinds == ("weight", "weight_scale_inv")
    assert "per block of 128x128, e4m3 activations per group" in blocks.describe()
    static = quantization_from_hf({"quant_method": "fp8", "activation_scheme": "static"})
    assert static.static_activations and static.block_structure is None
    method = quantization_method("fp8").linear_method(static, Placement(), False)
    assert method.weight_kinds == ("weight", "weight_scale", "input_scale")
    # (the head, the embeddings and the router stay float anyway)
    quantization_from_hf({"quant_method": "fp8", "modules_to_not_convert": ["lm_head", "gate"]})


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"fmt": "e5m2"}, r"fp8 checkpoints in 'e5m2' are not supported"),
        ({"activation_scheme": "per_tensor"}, r"activation_scheme 'per_tensor' is not supp"),
        ({"weight_block_size": [128]}, r"weight_block_size must be \[out, in\], got \[128\]"),
        ({"weight_block_size": [128, 128], "activation_scheme": "static"},
         r"quantizes activations per group .*not 'static'"),
        ({"modules_to_not_convert": ["model.layers.0.self_attn.q_a_proj"]},
         r"layers left float \(\['model.layers.0.self_attn.q_a_proj'\]\) are not supported"),
        ({"weight_block_size": [0, 128]}, r"block_structure must be two positive sizes"),
    ],
)  # fmt: skip
def test_bad_fp8_quantization_configs_are_refused_naming_the_problem(
    raw: dict,
    message: str,  # type: ignore[type-arg]
) -> None:
    with pytest.raises(ValueError, match=message):
        quantization_from_hf({"quant_method": "fp8", **raw})
