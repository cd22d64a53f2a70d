"""Rotary position embeddings (rotate-half form as Hugging Face Llama/Qwen, or interleaved
pairs as GPT-J), applied in place by the fused C++ op."""

from __future__ import annotations

import math
from typing import Any

import torch

from pyengine import ops


def inverse_frequencies(
    head_size: int, theta: float, scaling: dict[str, Any] | None, max_positions: int = 0
) -> torch.Tensor:
    """max_positions: the positions the model will run (LongRoPE's choice of factors)."""
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
    inv_freq = 1.0 / (theta**exponents)
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind is None:
        return inv_freq
    if kind == "longrope":
        assert scaling is not None
        return inv_freq / _longrope_factors(scaling, head_size, max_positions)
    if kind == "linear":
        assert scaling is not None
        return inv_freq / float(scaling["factor"])
    if kind == "freq_divisors":  # a GGUF's rope_freqs tensor (llama.cpp's Llama 3 scaling)
        assert scaling is not None
        divisors = torch.tensor(scaling["divisors"], dtype=torch.float64)
        if divisors.shape != inv_freq.shape:
            raise ValueError(
                f"rope_freqs has {divisors.numel()} divisors; head size {head_size} needs "
                f"{inv_freq.numel()}"
            )
        return (inv_freq.double() / divisors).float()
    if kind == "llama3":
        assert scaling is not None
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        assert scaling is not None
        return _yarn_frequencies(head_size, theta, scaling)
    raise ValueError(
        f"rope_scaling type {kind!r} is not supported (linear, llama3, yarn, longrope)"
    )


def _longrope_factors(scaling: dict[str, Any], head_size: int, max_positions: int) -> torch.Tensor:
    """LongRoPE's (Phi-3's) divisor of each frequency: its long factors where the model
    runs past the original context, else its short ones. The choice is made once, by
    the longest sequence the engine runs (max_model_len), as llama.cpp makes it by its
    context size: transformers switches by each forward's length, which the tokens
    match where both stay on one side of the original context."""
    long = max_positions > int(scaling["original_max_position_embeddings"])
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    if factors.shape != (head_size // 2,):
        raise ValueError(
            f"rope_scaling 'longrope' has {factors.numel()} factors; head size {head_size} "
            f"needs {head_size // 2}"
        )
    return factors


def _yarn_frequencies(head_size: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN's (gpt-oss, DeepSeek): each frequency between its interpolated (divided by
    `factor`) and its original value, by a linear ramp over the dimensions whose
    wavelengths lie between beta_fast and beta_slow rotations of the original context."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = (
        float(scaling.get("beta_fast") or 32),
        float(scaling.get("beta_slow") or 1),
    )

    def dimension(rotations: float) -> float:
        return head_size * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    if low == high:
        high += 0.001  # (no empty ramp)
    ramp = ((torch.arange(head_size // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    original_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2).float() / head_size))
    return original_freq / factor * (1 - extrapolation) + original_freq * extrapolation


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What a rope scaling multiplies cos and sin by: YaRN's 0.1 ln(factor) + 1 (or its
    attention_factor, or the ratio of its mscale and mscale_all_dim's), LongRoPE's
    sqrt(1 + ln(factor) / ln(original context)), else 1."""
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind not in ("yarn", "longrope"):
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if kind == "longrope":
        original = float(scaling["original_max_position_embeddings"])
        return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0

    def mscale(scale: float) -> float:
        return 0.1 * scale * math.log(factor) + 1.0 if factor > 1 else 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(float(m)) / mscale(float(m_all)) if m and m_all else mscale(1.0)


class RotaryEmbedding:
    """cos/sin per position, computed once for every position up to max_positions."""

    def __init__(
        self,
        head_size: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device | None = None,
        is_neox: bool = True,  # rotate-half pairs (i, i + d/2); else (2i, 2i + 1)
    ) -> None:
        self.is_neox = is_neox
        inv_freq = inverse_frequencies(head_size, theta, scaling, max_positions)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        # [max_positions, head_size]: cos of each frequency, then sin (times the scaling's
        # attention factor: YaRN's); float32 whatever the model's dtype.
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        factor = attention_factor(scaling)
        self.cos_sin_cache = (cos_sin * factor if factor != 1.0 else cos_sin).to(device)

    def __call__(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> None:
        """Rotates query [tokens, heads, dim] and key [tokens, kv_heads, dim] in place."""
        ops.rotary_embedding(positions, query, key, self.cos_sin_cache, self.is_neox)
