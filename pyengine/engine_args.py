"""EngineArgs: everything that builds an engine, as LLM(...) and `pyengine serve` take it."""

from __future__ import annotations

from dataclasses import dataclass

from pyengine.config import EngineConfig, default_kv_cache_memory
from pyengine.engine import LLMEngine
from pyengine.loader.resolve import DEFAULT_MODEL, load_model


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's positions
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes of CPU KV cache; None: the default
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 2048 (or max_model_len unchunked)
    seed: int = 0
    load_format: str = "auto"

    def create_engine(self) -> LLMEngine:
        if self.dtype not in ("auto", "float32"):
            raise ValueError(
                f"dtype {self.dtype!r}: the CPU backend runs float32 ('auto' or 'float32')"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        loaded = load_model(self.model, self.tokenizer, self.load_format)
        model_len = loaded.config.max_position_embeddings
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = model_len
        elif max_model_len > model_len:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's {model_len} positions"
            )
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        config = EngineConfig(
            max_model_len=max_model_len,
            block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory or default_kv_cache_memory(),
            enable_prefix_caching=self.enable_prefix_caching,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=batched,
            seed=self.seed,
        )
        return LLMEngine(loaded, config)
