"""A Hugging Face config.json's object as a ModelConfig. The model class that runs its
architecture (models/registry.py) reads its sizes and switches under its own names and
with its own defaults; this module reads what every config.json says alike (rope,
special tokens), and turns any missing or mistyped entry into a ValueError naming it."""

from __future__ import annotations

from typing import Any

from pyengine.config import ModelConfig
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
    elif rope_scaling.get("rope_type", rope_scaling.get("type")) in ("longrope", "su"):
        rope_scaling = _longrope(rope_scaling, config)
    return CommonValues(
        architecture=arch,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_ids(config.get("eos_token_id")),
    )


def _longrope(scaling: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE's parameters whole (Phi-3 keeps original_max_position_embeddings beside
    them; "su" is its older name): its factor, where not given, is max_position_embeddings
    over the original, as transformers takes it."""
    original = scaling.get("original_max_position_embeddings") or config.get(
        "original_max_position_embeddings"
    )
    factor = scaling.get("factor")
    if factor is None and original and config.get("max_position_embeddings"):
        factor = config["max_position_embeddings"] / original
    return {**scaling, "rope_type": "longrope", "original_max_position_embeddings": original,
            "factor": factor}  # fmt: skip


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)
