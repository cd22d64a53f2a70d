"""Model and engine configuration."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from pyengine.sampling_params import is_int, is_real

# The architectures this engine runs, by the name in a Hugging Face config.json.
LLAMA_LIKE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Learned absolute positions, LayerNorm, biases everywhere.
LEARNED_POSITIONS = ("OPTForCausalLM", "GPT2LMHeadModel")
ARCHITECTURES = LLAMA_LIKE + LEARNED_POSITIONS


@dataclass
class ModelConfig:
    """What the model runner needs of a checkpoint's config (Hugging Face names)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-6  # RMSNorm (Llama family) or LayerNorm (OPT, GPT-2) epsilon
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections have biases (Qwen2)
    qk_norm: bool = False  # RMSNorm of q and k per head (Qwen3)
    sliding_window: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # OPT / GPT-2
    hidden_act: str = "silu"
    norm_before: bool = True  # pre-LN (else post-LN, as OPT-350m)
    position_offset: int = 0  # OPT's learned positions start at row 2

    def __post_init__(self) -> None:
        """Values a model cannot run with are refused when loaded, not at the first
        request (or, worse, run into NaN)."""
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim",
                    "max_position_embeddings")  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not is_real(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not is_int(self.sliding_window) or self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window!r}")
        _check_rope_scaling(self.rope_scaling)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        """From a config.json's object; a missing or mistyped entry is a ValueError that
        names it."""
        if not isinstance(config, dict):
            raise ValueError(f"a config must hold an object, got {type(config).__name__}")
        try:
            return cls._from_hf(config)
        except KeyError as error:
            raise ValueError(f"the config lacks {error}") from None
        except (TypeError, ValueError) as error:
            raise ValueError(f"the config: {error}") from None

    @classmethod
    def _from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        architectures = config.get("architectures") or []
        if not isinstance(architectures, list) or not architectures:
            raise ValueError("the config names no architecture ('architectures', a list)")
        arch = architectures[0]
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"architecture {arch} is not supported; pyengine runs {', '.join(ARCHITECTURES)}"
            )
        if arch == "GPT2LMHeadModel":
            return cls._from_gpt2(config)
        if arch == "OPTForCausalLM":
            return cls._from_opt(config)
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
        return cls(
            architecture=arch,
            vocab_size=_integer(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=_integer(config["intermediate_size"]),
            num_hidden_layers=_integer(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=_integer(config.get("num_key_value_heads") or heads),
            head_dim=_integer(config.get("head_dim") or _split(hidden, heads)),
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

    @classmethod
    def _from_gpt2(cls, config: dict[str, Any]) -> ModelConfig:
        hidden, heads = _integer(config["n_embd"]), _integer(config["n_head"])
        if config.get("scale_attn_by_inverse_layer_idx") or not config.get(
            "scale_attn_weights", True
        ):
            raise ValueError("GPT-2 variants with other attention scaling are not supported")
        return cls(
            architecture="GPT2LMHeadModel",
            vocab_size=_integer(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=_integer(config.get("n_inner") or 4 * hidden),
            num_hidden_layers=_integer(config["n_layer"]),
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=_split(hidden, heads),
            max_position_embeddings=_integer(config.get("n_positions", 1024)),
            norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_ids(config.get("eos_token_id")),
            hidden_act=str(config.get("activation_function", "gelu_new")),
        )

    @classmethod
    def _from_opt(cls, config: dict[str, Any]) -> ModelConfig:
        hidden, heads = _integer(config["hidden_size"]), _integer(config["num_attention_heads"])
        if _integer(config.get("word_embed_proj_dim") or hidden) != hidden:
            raise ValueError("OPT models with word_embed_proj_dim != hidden_size are not supported")
        return cls(
            architecture="OPTForCausalLM",
            vocab_size=_integer(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=_integer(config["ffn_dim"]),
            num_hidden_layers=_integer(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=_split(hidden, heads),
            max_position_embeddings=_integer(config.get("max_position_embeddings", 2048)),
            norm_eps=1e-5,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_ids(config.get("eos_token_id")),
            hidden_act=str(config.get("activation_function", "relu")),
            norm_before=bool(config.get("do_layer_norm_before", True)),
            position_offset=2,
        )


# rope_scaling types and the positive numbers each needs ("freq_divisors": a GGUF's
# rope_freqs tensor, see loader/gguf_model.py).
_ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "freq_divisors": (),
}  # fmt: skip


def _check_rope_scaling(scaling: Any) -> None:
    if scaling is None:
        return
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind not in _ROPE_SCALING_KEYS:
        raise ValueError(
            f"rope_scaling {scaling!r:.80} is not supported (a dict of rope_type "
            f"{', '.join(_ROPE_SCALING_KEYS)})"
        )
    values = [scaling.get(key) for key in _ROPE_SCALING_KEYS[kind]]
    if kind == "freq_divisors":
        values = list(scaling.get("divisors") or [None])
    for value in values:
        if not is_real(value) or value <= 0:
            raise ValueError(f"rope_scaling {kind!r} needs positive numbers, got {scaling!r:.120}")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError("rope_scaling 'llama3': high_freq_factor must exceed low_freq_factor")


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


def default_kv_cache_memory() -> int:
    """Bytes of CPU KV cache: PYENGINE_CPU_KV_CACHE_GIB (GiB) or 2 GiB."""
    gib = os.environ.get("PYENGINE_CPU_KV_CACHE_GIB", "2")
    try:
        value = float(gib)
    except ValueError:
        raise ValueError(
            f"PYENGINE_CPU_KV_CACHE_GIB must be a number of GiB, got {gib!r}"
        ) from None
    if value <= 0:
        raise ValueError(f"PYENGINE_CPU_KV_CACHE_GIB must be positive, got {gib!r}")
    return int(value * 2**30)


def kv_cache_dtype_supported(kv_cache_dtype: str, dtype: str, device: str) -> bool:
    """A KV cache in the model's dtype anywhere; a 16-bit one under float32 weights on the
    CPU, whose kernels read it as float32."""
    return kv_cache_dtype == dtype or (
        device == "cpu" and dtype == "float32" and kv_cache_dtype in ("bfloat16", "float16")
    )


@dataclass
class EngineConfig:
    """The engine's limits, as LLM(...) takes them."""

    max_model_len: int
    block_size: int = 16
    kv_cache_memory: int = field(default_factory=default_kv_cache_memory)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    seed: int = 0
    device: str = "cpu"  # "cpu" or "cuda[:N]"
    dtype: str = "float32"  # of the weights and activations
    kv_cache_dtype: str | None = None  # None: dtype; else float16/bfloat16 under float32 (CPU)
    gpu_memory_utilization: float = 0.9  # on CUDA: the share of the device's memory to use
    enforce_eager: bool = False  # on CUDA: no CUDA graphs for decode steps
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for

    @property
    def cache_dtype(self) -> str:
        return self.kv_cache_dtype or self.dtype

    def __post_init__(self) -> None:
        checks = {
            "max_model_len": self.max_model_len >= 1,
            "block_size": self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
            "kv_cache_memory": self.kv_cache_memory > 0,
            "max_num_seqs": self.max_num_seqs >= 1,
            "max_num_batched_tokens": self.max_num_batched_tokens >= 1,
            "dtype": self.dtype in ("float32", "bfloat16", "float16"),
            "kv_cache_dtype": self.kv_cache_dtype is None
            or kv_cache_dtype_supported(self.kv_cache_dtype, self.dtype, self.device),
            "gpu_memory_utilization": 0 < self.gpu_memory_utilization <= 1,
            "max_logprobs": self.max_logprobs >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name}: invalid value {getattr(self, name)!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len}) without chunked prefill"
            )
