"""A Hugging Face config.json's object as a ModelConfig: each architecture's names for
the sizes, defaults as transformers has them, and a ValueError naming any entry a model
cannot run with."""

from __future__ import annotations

from typing import Any

from pyengine.config import ModelConfig

# A quantization_config is read by the method it names (layers/quantization/).
from pyengine.layers.quantization.registry import quantization_from_hf as quantization_from_hf
from pyengine.models.registry import ARCHITECTURES


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
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"architecture {arch} is not supported; pyengine runs {', '.join(ARCHITECTURES)}"
        )
    if arch == "GPT2LMHeadModel":
        return _from_gpt2(config)
    if arch == "OPTForCausalLM":
        return _from_opt(config)
    heads = _integer(config["num_attention_heads"])
    hidden = _integer(config["hidden_size"])
    rope_scaling = config.get("rope_scaling") or config.get("rope_parameters")
    parameters = rope_scaling if isinstance(rope_scaling, dict) else {}
    rope_theta = float(config.get("rope_theta") or parameters.get("rope_theta", 10000.0))
    if not isinstance(rope_scaling, dict):
        rope_scaling = rope_scaling or None  # anything else: ModelConfig refuses it
    elif rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
        rope_scaling = None
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    kv_heads = _integer(config.get("num_key_value_heads") or heads)
    if kv_heads >= 1 and heads % kv_heads:  # named as config.json names it
        raise ValueError(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    return ModelConfig(
        architecture=arch,
        vocab_size=_integer(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=_integer(config["intermediate_size"]),
        num_layers=_integer(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=_integer(config.get("head_dim") or _split(hidden, heads)),
        max_position_embeddings=_integer(config.get("max_position_embeddings", 2048)),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", arch == "Qwen2ForCausalLM")),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=_integer(window or 0) if arch == "MistralForCausalLM" else 0,
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_ids(config.get("eos_token_id")),
    )


def _from_gpt2(config: dict[str, Any]) -> ModelConfig:
    hidden, heads = _integer(config["n_embd"]), _integer(config["n_head"])
    if config.get("scale_attn_by_inverse_layer_idx") or not config.get("scale_attn_weights", True):
        raise ValueError("GPT-2 variants with other attention scaling are not supported")
    return ModelConfig(
        architecture="GPT2LMHeadModel",
        vocab_size=_integer(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=_integer(config.get("n_inner") or 4 * hidden),
        num_layers=_integer(config["n_layer"]),
        num_heads=heads,
        num_kv_heads=heads,
        head_size=_split(hidden, heads),
        max_position_embeddings=_integer(config.get("n_positions", 1024)),
        norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_ids(config.get("eos_token_id")),
        hidden_act=str(config.get("activation_function", "gelu_new")),
    )


def _from_opt(config: dict[str, Any]) -> ModelConfig:
    hidden, heads = _integer(config["hidden_size"]), _integer(config["num_attention_heads"])
    if _integer(config.get("word_embed_proj_dim") or hidden) != hidden:
        raise ValueError("OPT models with word_embed_proj_dim != hidden_size are not supported")
    return ModelConfig(
        architecture="OPTForCausalLM",
        vocab_size=_integer(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=_integer(config["ffn_dim"]),
        num_layers=_integer(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=heads,
        head_size=_split(hidden, heads),
        max_position_embeddings=_integer(config.get("max_position_embeddings", 2048)),
        norm_eps=1e-5,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_ids(config.get("eos_token_id")),
        hidden_act=str(config.get("activation_function", "relu")),
        norm_before=bool(config.get("do_layer_norm_before", True)),
        position_offset=2,
    )


def _split(hidden: int, heads: int) -> int:
    if heads < 1 or hidden % heads:
        raise ValueError(f"hidden size {hidden} does not split into {heads} attention heads")
    return hidden // heads


def _integer(value: Any) -> int:
    """A config.json count: an integer (or a float that is one), nothing else."""
    if isinstance(value, bool) or not (
        isinstance(value, int) or isinstance(value, float) and value.is_integer()
    ):
        raise ValueError(f"{value!r} where an integer belongs")
    return int(value)


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)
