"""A Hugging Face config.json's object as a ModelConfig. The model class that runs its
architecture (models/registry.py) reads its sizes and switches under its own names and
with its own defaults; this module reads what every config.json says alike (rope,
special tokens), and turns any missing or mistyped entry into a ValueError naming it."""

from __future__ import annotations

import dataclasses
from typing import Any

from pyengine.config import QUANTIZATION_METHODS, ModelConfig, QuantizationConfig
from pyengine.models.checkpoint_config import CommonValues
from pyengine.models.registry import model_class


def model_config_from_hf(config: dict[str, Any]) -> ModelConfig:
    """From a config.json's object; a missing or mistyped entry is a ValueError that
    names it."""
    if not isinstance(config, dict):
        raise ValueError(f"a config must hold an object, got {type(config).__name__}")
    try:
        return _from_hf(config)
    except KeyError as error:
        raise ValueError(f"the config lacks {error}") from None
    except (TypeError, ValueError) as error:
        raise ValueError(f"the config: {error}") from None


def _from_hf(config: dict[str, Any]) -> ModelConfig:
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not architectures:
        raise ValueError("the config names no architecture ('architectures', a list)")
    arch = architectures[0]
    return model_class(arch).config_from_hf(config, _common_values(config, arch))


def _common_values(config: dict[str, Any], arch: str) -> CommonValues:
    """The rope (rope_scaling, or transformers' newer rope_parameters, which also holds
    rope_theta; a "default" one is none) and the special tokens."""
    rope_scaling = config.get("rope_scaling") or config.get("rope_parameters")
    parameters = rope_scaling if isinstance(rope_scaling, dict) else {}
    rope_theta = float(config.get("rope_theta") or parameters.get("rope_theta", 10000.0))
    if not isinstance(rope_scaling, dict):
        rope_scaling = rope_scaling or None  # anything else: ModelConfig refuses it
    elif rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
        rope_scaling = None
    return CommonValues(
        architecture=arch,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_ids(config.get("eos_token_id")),
    )


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def quantization_from_hf(raw: Any) -> QuantizationConfig:
    """A config.json's `quantization_config` (GPTQ as AutoGPTQ / GPTQModel write it, AWQ
    as AutoAWQ's GEMM format, compressed-tensors as llm-compressor does); ValueError
    naming what is not supported."""
    method = raw.get("quant_method") if isinstance(raw, dict) else None
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantized checkpoints ({method or 'quantization_config'}) are not supported "
            f"(supported: {', '.join(QUANTIZATION_METHODS)}); give float weights, or a GGUF file"
        )
    assert isinstance(raw, dict)
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    # Checked by QuantizationConfig (a missing or odd value is named there).
    bits: Any = raw.get("bits", raw.get("w_bit"))
    group_size: Any = raw.get("group_size", raw.get("q_group_size"))
    if method == "awq":
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm" or raw.get("zero_point") is False:
            raise ValueError(
                f"awq version {version!r} (zero_point {raw.get('zero_point')!r}) is not "
                "supported: AutoAWQ's GEMM packing with zero points"
            )
        return QuantizationConfig("awq", bits, group_size)
    checkpoint_format = raw.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq checkpoint_format {checkpoint_format!r} is not supported")
    return QuantizationConfig(
        "gptq", bits, group_size, bool(raw.get("desc_act", False)),
        zero_offset=1 if checkpoint_format == "gptq" else 0,
    )  # fmt: skip


# compressed-tensors' W8A8: int8 weights, a scale per output channel, and int8
# activations quantized per token as each step runs.
# (each key's allowed values)
_W8A8_WEIGHTS = {"num_bits": (8,), "type": ("int",), "symmetric": (True,), "strategy": ("channel",)}
_W8A8_ACTIVATIONS = {
    "num_bits": (8,), "type": ("int",), "symmetric": (True,), "strategy": ("token",),
    "dynamic": (True,),
}  # fmt: skip
# FP8: e4m3 weights with a scale per channel or per tensor, e4m3 activations quantized
# per token as each step runs (dynamic) or by the checkpoint's input_scale per tensor
# (static), or float activations (no input_activations).
_FP8_WEIGHTS = {
    "num_bits": (8,), "type": ("float",), "symmetric": (True,),
    "strategy": ("channel", "tensor", "block"), "dynamic": (False, None),
}  # fmt: skip
_FP8_ACTIVATIONS = {
    "num_bits": (8,), "type": ("float",), "symmetric": (True,),
    "strategy": ("token", "tensor", "group"), "dynamic": (True, False),
}  # fmt: skip
# W4A16: 4-bit symmetric weights per group or per channel; with actorder "group" (or
# true) the groups are in activation order, a `weight_g_idx` per input; "weight" (or
# "static") orders only the quantization, the groups stay contiguous.
_W4A16_WEIGHTS = {
    "num_bits": (4,), "type": ("int",), "symmetric": (True,), "strategy": ("group", "channel"),
    "actorder": (None, False, True, "group", "weight", "static"), "dynamic": (False, None),
}  # fmt: skip


def _compressed_tensors(raw: dict[str, Any]) -> QuantizationConfig:
    """llm-compressor's format: one scheme for every Linear layer (the head may be left
    out), int-quantized W8A8, float-quantized FP8 or pack-quantized W4A16; what else it
    can say is refused, by name."""
    form = raw.get("format")
    if form not in ("int-quantized", "float-quantized", "naive-quantized", "pack-quantized"):
        raise ValueError(
            f"compressed-tensors format {form!r} is not supported (int-quantized W8A8, "
            "float-quantized FP8, pack-quantized W4A16)"
        )
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("compressed-tensors: config_groups is missing")
    configs = {_compressed_group(name, group, form) for name, group in groups.items()}
    if len(configs) > 1:
        raise ValueError("compressed-tensors: groups of different schemes are not supported")
    ignored = [i for i in raw.get("ignore") or [] if i != "lm_head"]
    if ignored:
        raise ValueError(
            f"compressed-tensors: ignore {ignored} is not supported (only lm_head may stay float)"
        )
    config = configs.pop()
    kv = raw.get("kv_cache_scheme")
    if kv:
        wanted = {"num_bits": (8,), "type": ("int", "float"), "symmetric": (True,),
                  "strategy": ("tensor",), "dynamic": (False, None)}  # fmt: skip
        _check_scheme("kv_cache_scheme", [("kv_cache_scheme", kv, wanted)], "8-bit KV cache")
        kind = "int8" if kv.get("type") == "int" else "fp8"
        config = dataclasses.replace(config, kv_cache_scales=kind)
    return config


def _compressed_group(name: str, group: Any, form: str) -> QuantizationConfig:
    if not isinstance(group, dict) or group.get("targets") != ["Linear"]:
        raise ValueError(
            f"compressed-tensors group {name!r}: only targets ['Linear'] are supported"
        )
    w4a16 = form == "pack-quantized"
    fp8 = not w4a16 and (group.get("weights") or {}).get("type") == "float"
    if form in ("int-quantized", "float-quantized") and fp8 != (form == "float-quantized"):
        wanted = "float weights (FP8)" if form == "float-quantized" else "int weights (W8A8)"
        raise ValueError(
            f"compressed-tensors format {form!r} is for {wanted}, group {name!r} has "
            f"{'float' if fp8 else 'int'} ones"
        )
    if fp8:
        return _fp8_group(name, group)
    weights = _W4A16_WEIGHTS if w4a16 else _W8A8_WEIGHTS
    parts = [("weights", group.get("weights"), weights)]
    if not w4a16:
        parts.append(("input_activations", group.get("input_activations"), _W8A8_ACTIVATIONS))
    _check_scheme(name, parts, "W4A16" if w4a16 else "W8A8")
    if not w4a16:
        return QuantizationConfig("compressed-tensors", 8, -1, activation_bits=8)
    if group.get("input_activations"):
        raise ValueError(
            f"compressed-tensors group {name!r}: pack-quantized with quantized activations "
            "is not supported"
        )
    scheme = group["weights"]
    grouped = scheme.get("strategy") == "group"
    size = scheme.get("group_size") if grouped else -1
    activation_order = scheme.get("actorder") in (True, "group")
    if activation_order and not grouped:
        raise ValueError(
            f"compressed-tensors group {name!r}: actorder {scheme.get('actorder')!r} orders "
            "groups, and strategy 'channel' has none"
        )
    return QuantizationConfig("compressed-tensors", 4, size, desc_act=activation_order)


def _fp8_group(name: str, group: dict[str, Any]) -> QuantizationConfig:
    activations = group.get("input_activations")
    parts = [("weights", group.get("weights"), _FP8_WEIGHTS)]
    if activations:
        parts.append(("input_activations", activations, _FP8_ACTIVATIONS))
    _check_scheme(name, parts, "FP8")
    block = None
    if group["weights"].get("strategy") == "block":  # FP8_BLOCK
        structure = group["weights"].get("block_structure")
        if not (isinstance(structure, list) and len(structure) == 2):
            raise ValueError(
                f"compressed-tensors group {name!r}: block weights need a block_structure "
                f"[out, in], got {structure!r}"
            )
        block = (structure[0], structure[1])
    if not activations:
        return QuantizationConfig(
            "compressed-tensors", 8, -1, weight_type="float", block_structure=block
        )
    strategy = activations.get("strategy")
    static = strategy == "tensor"
    if static == bool(activations.get("dynamic")):
        raise ValueError(
            f"compressed-tensors group {name!r}: FP8 activations are dynamic per token or "
            f"group, or static per tensor, not {strategy!r} with dynamic "
            f"{activations.get('dynamic')!r}"
        )
    group_size = activations.get("group_size") if strategy == "group" else 0
    if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
        raise ValueError(
            f"compressed-tensors group {name!r}: group activations need a group_size, got "
            f"{group_size!r}"
        )
    return QuantizationConfig(
        "compressed-tensors", 8, -1, activation_bits=8, weight_type="float",
        static_activations=static, block_structure=block, activation_group=group_size,
    )  # fmt: skip


def _check_scheme(name: str, parts: Any, scheme_name: str) -> None:
    """Each (part, its scheme, each key's allowed values): ValueError naming the odd keys."""
    for part, scheme, wanted in parts:
        scheme = scheme or {}
        odd = {
            key: scheme.get(key) for key, value in wanted.items() if scheme.get(key) not in value
        }
        if odd:
            raise ValueError(
                f"compressed-tensors group {name!r}: {part} {odd} are not supported "
                f"({scheme_name}: {part} {wanted})"
            )
