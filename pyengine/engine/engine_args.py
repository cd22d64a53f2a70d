"""EngineArgs: everything that builds an engine, as LLM(...) and `pyengine serve` take it."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pyengine import built_with_cuda
from pyengine.config import (
    RECURRENT_SPEC,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    QuantizationConfig,
    default_kv_cache_memory,
    kv_cache_dtype_supported,
)
from pyengine.engine.llm_engine import LLMEngine
from pyengine.engine.pooling import resolve_pooler
from pyengine.engine.precision import DTYPE_NAMES, Precision, choose_precision, cpu_kernels
from pyengine.executor.registry import check_executor, runs_in_this_process
from pyengine.layers.placement import Placement
from pyengine.loader.resolve import DEFAULT_MODEL, load_model, quantized_form
from pyengine.sampling_params import is_real
from pyengine.spec_decode.config import SpeculativeConfig
from pyengine.spec_decode.registry import create_proposer

logger = logging.getLogger("pyengine")


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    # of the KV cache: "auto" (the model's dtype), or on the CPU, under float32 weights,
    # "bfloat16"/"float16": half the memory and half the bytes decode attention reads
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's positions
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes of CPU KV cache; None: the default
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_seqs: int = 256
    # None: 2048 on the CPU, 8192 on a GPU (at least max_model_len without chunked prefill)
    max_num_batched_tokens: int | None = None
    seed: int = 0
    load_format: str = "auto"
    # "gptq", "awq", "compressed-tensors" or "fp8"; None: the checkpoint's quantization_config
    # says (or float weights)
    quantization: str | None = None
    # How block-quantized layers (GGUF's, GPTQ/AWQ's) on the CPU take a step's
    # activations: "float32", the dequantized weights' exact float32 product (greedy
    # tokens those of transformers on them); "int8", quantized per block of 32 and
    # multiplied in integers, as llama.cpp (and vLLM's GGUF kernels) do: several times
    # fewer instructions, at the cost of the activations' rounding to 8 bits; "auto",
    # int8 where dtype is "auto" and the CPU has VNNI, else float32 (engine/precision.py).
    quantized_activations: str = "auto"
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for
    # "fcfs" (arrival order), or "priority": a request's priority first (lower first, as
    # vLLM), and preemption takes the lowest-priority running request first
    scheduling_policy: str = "fcfs"
    # A host-memory tier of the KV cache, GiB per worker (0: none; pinned memory on a
    # GPU): prefix-cache blocks evicted from the device pool are copied there and brought
    # back on a later hit instead of being recomputed.
    kv_offload_gb: float = 0.0
    # On the CPU: the tier in a file in this folder (a prefix cache larger than memory).
    kv_offload_dir: str | None = None
    # "recompute": a preempted request's blocks are freed, its tokens computed again;
    # "swap" (with kv_offload_gb): its blocks are copied to the host tier and back.
    preemption_mode: str = "recompute"
    # Hybrid models with prefix caching: their recurrent states are checkpointed every
    # this many blocks (and at each prompt's last full block), hits resuming from the
    # last checkpoint. A larger interval keeps each checkpoint that many times longer in
    # the same memory; a hit may then end up to interval - 1 blocks earlier.
    state_checkpoint_interval: int = 1

    # Ranks per pipeline stage, and stages; their product is the number of workers.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "uni", "mp" or "ray"; None: "uni" for one rank, else "mp" (a process per rank).
    distributed_executor_backend: str | None = None
    # Mixture-of-experts layers over tensor_parallel_size ranks: each rank holds whole
    # experts (a 1/tp share of them) rather than a 1/tp slice of every expert.
    enable_expert_parallel: bool = False

    enforce_eager: bool = False  # decode steps eagerly, not as CUDA graphs or recorded CPU steps

    # Multi-LoRA: requests name adapters (lora_request); up to max_loras of them on the
    # device and in one step, ranks up to max_lora_rank, up to max_cpu_loras (None:
    # max_loras) kept in host memory.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Speculative decoding, in vLLM's form: {"method": "ngram", "num_speculative_tokens":
    # k, "prompt_lookup_min": 1, "prompt_lookup_max": 4} (docs/speculative.md).
    speculative_config: Mapping[str, object] | SpeculativeConfig | None = None
    device: str = "auto"  # "auto": a CUDA GPU where there is one (and a CUDA build), else "cpu"
    # "generate"; "pooling": embeddings, classifications and scores (LLM.embed,
    # LLM.classify, LLM.score; /v1/embeddings, /v1/score, /v1/rerank); "auto": pooling
    # for an encoder, else generate.
    runner: str = "auto"
    # The pooling runner's, as vLLM's --pooler-config: {"pooling_type": "LAST" | "CLS" |
    # "MEAN", "normalize": bool, "classifier_from_token": ["no", "yes"]} (the last, a
    # decoder scored by those tokens' logits: Qwen3-Reranker's form)
    pooler_config: Mapping[str, object] | None = None

    def create_engine(self) -> LLMEngine:
        start = time.perf_counter()
        speculative = SpeculativeConfig.parse(self.speculative_config)  # (before any loading)
        device = resolve_device(self.device)
        precision = self.precision(device)
        dtype = precision.dtype
        kv_cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, dtype, device)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if not is_real(self.kv_offload_gb) or not 0 <= self.kv_offload_gb < 2**20:
            raise ValueError(f"kv_offload_gb must be a size in GiB, got {self.kv_offload_gb!r}")
        parallel = self.parallel_config()
        proposer = None if speculative is None else create_proposer(speculative)
        if proposer is not None:
            proposer.check_engine(parallel.world_size, bool(self.kv_offload_gb))
        keeps_blocks = Placement(torch.device(device), getattr(torch, dtype)).keeps_gguf_blocks
        # With workers of their own, each reads its shards itself: here the config only.
        loaded = load_model(
            self.model, self.tokenizer, self.load_format, keep_block_quantized=keeps_blocks,
            read_weights=runs_in_this_process(parallel),
        )  # fmt: skip
        check_quantization(self.quantization, loaded.config.quantization, self.model)
        pooler = resolve_pooler(
            self.runner, self.pooler_config, loaded.config, loaded.source, loaded.tokenizer
        )
        prefix_caching = self.enable_prefix_caching
        if loaded.config.has_recurrent_layers():
            prefix_caching = _hybrid_prefix_caching(
                loaded.config, prefix_caching, self.kv_offload_gb > 0, self.enable_lora
            )
        model_len = loaded.config.max_position_embeddings
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = model_len
        elif max_model_len > model_len:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's {model_len} positions"
            )
        draft_cost = 0.0
        if proposer is not None:
            draft_cost = proposer.draft_token_cost(loaded.config, max_model_len, _read_config)
        chunked_prefill = self.enable_chunked_prefill
        if pooler is not None:
            # A pooling prompt runs whole in one step (an encoder's attention sees all of
            # it; a mean needs every row), and its states are never reused.
            _check_pooling(self, speculative)
            prefix_caching = chunked_prefill = False
        batched = self.max_num_batched_tokens
        if batched is None:
            # A GPU's matmuls want big steps; a CPU's prefill step is seconds already.
            batched = 2048 if device == "cpu" else 8192
            if not chunked_prefill:
                batched = max(batched, max_model_len)
        config = EngineConfig(
            max_model_len=max_model_len,
            block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory or default_kv_cache_memory(),
            enable_prefix_caching=prefix_caching,
            enable_chunked_prefill=chunked_prefill,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=batched,
            seed=self.seed,
            device=device,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager,
            max_logprobs=self.max_logprobs,
            scheduling_policy=self.scheduling_policy,
            kv_offload_bytes=int(self.kv_offload_gb * 2**30),
            kv_offload_dir=self.kv_offload_dir,
            preemption_mode=self.preemption_mode,
            state_checkpoint_interval=self.state_checkpoint_interval,
            parallel=parallel,
            quantized_activations=precision.quantized_activations,
            lora=LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
            if self.enable_lora
            else None,
            speculative=speculative,
            draft_token_cost=draft_cost,
            pooler=pooler,
        )
        engine = LLMEngine(loaded, config)
        logger.info("engine ready in %.1f s", time.perf_counter() - start)
        return engine

    def precision(self, device: str) -> Precision:
        """The dtype the model computes in (dtype "auto" resolved), logged with its reason
        and the matmul kernels it runs on."""
        quantized = None
        if device == "cpu":
            quantized = self.quantization or quantized_form(self.model, self.load_format)
        cache = cache_dtype_name(self.kv_cache_dtype)  # (a bad name refused before any log)
        precision = choose_precision(
            self.dtype, device, quantized, cache, self.quantized_activations
        )
        kernels = cpu_kernels(precision.dtype) if device == "cpu" and quantized is None else None
        logger.info(
            "precision: %s (%s)%s", precision.dtype, precision.reason,
            f"; matmuls: {kernels}" if kernels else "",
        )  # fmt: skip
        return precision

    def parallel_config(self) -> ParallelConfig:
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        backend = self.distributed_executor_backend or ("uni" if world == 1 else "mp")
        parallel = ParallelConfig(
            self.tensor_parallel_size, self.pipeline_parallel_size, backend,
            self.enable_expert_parallel,
        )  # fmt: skip
        check_executor(parallel)
        return parallel


def _hybrid_prefix_caching(
    config: ModelConfig, prefix_caching: bool, host_tier: bool, lora: bool
) -> bool:
    """A model with recurrent-state layers refuses LoRA adapters (its mixers' projections
    take none). Its prefix hits resume states from checkpoints, which the KV-cache
    manager keeps with one KV-cache group and no host tier: with a host tier
    (kv_offload_gb) or attention layers of several kinds, prefix caching is off."""
    if lora:
        raise ValueError(
            f"enable_lora: LoRA adapters on {config.architecture}, a model with "
            "recurrent-state layers, are not supported"
        )
    kinds = {spec for spec in config.kv_specs() if spec != RECURRENT_SPEC}
    if prefix_caching and (host_tier or len(kinds) > 1):
        logger.info(
            "prefix caching is off: %s keeps recurrent states, whose checkpoints are kept "
            "with no host tier and one attention kind", config.architecture,
        )  # fmt: skip
        return False
    return prefix_caching


def _check_pooling(args: EngineArgs, speculative: SpeculativeConfig | None) -> None:
    """What the pooling runner does not take."""
    if speculative is not None:
        raise ValueError("speculative decoding generates tokens; the pooling runner makes none")
    if args.enable_lora:
        raise ValueError("enable_lora: LoRA adapters on the pooling runner are not supported")
    if args.pipeline_parallel_size > 1:
        raise ValueError("the pooling runner runs on one pipeline stage")


def _read_config(model: str) -> ModelConfig:
    """A model's config, without its weights or tokenizer (a draft model's, checked)."""
    return load_model(model, read_weights=False, read_tokenizer=False).config


def check_quantization(asked: str | None, found: QuantizationConfig | None, model: str) -> None:
    """A quantization asked for must be the checkpoint's own."""
    if asked is None:
        return
    if found is None:
        raise ValueError(
            f"quantization {asked!r} was asked for, and {model} has no quantization_config "
            "(float weights)"
        )
    if asked != found.method:
        raise ValueError(
            f"quantization {asked!r} was asked for, and {model} is a {found.method} checkpoint"
        )


def resolve_device(device: str) -> str:
    """ "auto" -> "cuda" where torch sees a GPU and pyengine has its CUDA kernels, else
    "cpu"; "cpu", "cuda" and "cuda:N" are checked to be usable."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() and built_with_cuda() else "cpu"
    if device == "cpu":
        return device
    if device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        if not built_with_cuda():
            raise ValueError(f"device {device!r}: pyengine was built without CUDA")
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: torch sees no CUDA GPU")
        index = int(device[5:]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: torch sees {torch.cuda.device_count()} GPUs")
        return device
    raise ValueError(f"device {device!r}: expected 'auto', 'cpu', 'cuda' or 'cuda:N'")


# kv_cache_dtype's names: the dtypes', vLLM's of an fp8 cache (e4m3, a per-tensor scale
# of 1), and int8 (a scale per token and kv head)
_KV_CACHE_DTYPE_NAMES = {
    **DTYPE_NAMES, "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "int8": "int8"
}  # fmt: skip


def cache_dtype_name(kv_cache_dtype: str) -> str | None:
    """kv_cache_dtype's dtype, its aliases resolved; None for "auto" (the model's)."""
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype not in _KV_CACHE_DTYPE_NAMES:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r}: expected 'auto', 'float32', 'bfloat16', "
            "'float16', 'fp8' (e4m3) or 'int8'"
        )
    return _KV_CACHE_DTYPE_NAMES[kv_cache_dtype]


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str, device: str) -> str:
    """ "auto" -> the model's dtype. Another cache dtype where kv_cache_dtype_supported
    says: 16-bit, fp8 or int8 under float32 weights on the CPU, fp8 or int8 under 16-bit
    weights on CUDA."""
    resolved = cache_dtype_name(kv_cache_dtype)
    if resolved is None:
        return dtype
    if not kv_cache_dtype_supported(resolved, dtype, device):
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} with dtype {dtype!r} on {device}: a cache "
            "dtype other than the model's needs float32 weights on the CPU, or on CUDA "
            "float16/bfloat16 weights and an fp8 or int8 cache"
        )
    return resolved
