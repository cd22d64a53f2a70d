"""Model and engine configuration."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, TypeVar

from pyengine.sampling_params import is_int, is_real
from pyengine.spec_decode.config import SpeculativeConfig


@dataclass(frozen=True)
class QuantizationConfig:
    """A quantized checkpoint's scheme (its config.json's `quantization_config`):
    `bits`-bit weights in groups of `group_size` input features (-1: one group per
    output channel), each group with a scale (and, for GPTQ/AWQ, a zero point); with
    `activation_bits`, activations quantized too, per token, as each step runs (W8A8), or
    by a scale of the checkpoint's (`static_activations`). `weight_type` "float": fp8
    e4m3 weights and activations (compressed-tensors' FP8, or the fp8 quant_method's), a
    scale per channel, tensor or block.

    A plain value: the method it names checks it when it is read from a checkpoint
    (layers/quantization/registry.py, check_quantization_config)."""

    method: str  # a registered method's name: "gptq", "awq", "compressed-tensors", "fp8"...
    bits: int
    group_size: int
    desc_act: bool = False  # GPTQ: groups in activation order (a g_idx per input feature)
    # GPTQ's original format stores each zero point less 1 ("gptq"); "gptq_v2" does not.
    zero_offset: int = 0
    activation_bits: int = 0  # 0: float activations (weight-only)
    weight_type: str = "int"  # or "float": fp8 e4m3
    static_activations: bool = False  # a per-tensor input_scale instead of per token
    # FP8_BLOCK: a weight scale per block of [out, in] features (None: per channel or
    # tensor), and dynamic activation scales per group of this many inputs (0: per token)
    block_structure: tuple[int, int] | None = None
    activation_group: int = 0
    # compressed-tensors' kv_cache_scheme: a static k_scale and v_scale per layer, for the
    # KV cache of that dtype: "int8" (kv_cache_dtype="int8" takes them instead of its
    # per-token ones) or "fp8" (kv_cache_dtype="fp8" stores x / scale); None: no scheme.
    kv_cache_scales: str | None = None

    @property
    def pack_factor(self) -> int:
        """Weights in one int32 of the checkpoint."""
        return 32 // self.bits

    def describe(self) -> str:
        if self.method == "mxfp4":
            return "mxfp4 experts (e2m1 weights, a power-of-two scale per 32)"
        if self.weight_type == "float":
            per = "group of inputs" if self.activation_group else "token"
            activations = (
                "float activations" if not self.activation_bits
                else "e4m3 activations per " + ("tensor (static)" if self.static_activations
                                               else per)
            )  # fmt: skip
            blocks = self.block_structure
            weights = "per channel" if blocks is None else f"per block of {blocks[0]}x{blocks[1]}"
            return f"{self.method} FP8 e4m3 weights {weights}, {activations}"
        if self.activation_bits:
            return f"{self.method} W{self.bits}A{self.activation_bits} int, per channel and token"
        return f"{self.method} {self.bits}-bit, groups of {self.group_size}"


# The KV-cache spec of a layer that keeps a recurrent state (Gated DeltaNet, Mamba-2)
# instead of keys and values.
RECURRENT_SPEC = ("recurrent", 0)
# The spec of a layer that keeps nothing between steps: an encoder's, whose prompt runs
# whole in one step and attends to that step's keys alone.
NO_CACHE_SPEC = ("none", 0)


@dataclass(frozen=True)
class FamilyConfig:
    """A model family's own switches, which only its model class reads (such as Qwen3's
    per-head q/k norm): each family subclasses it beside its model class, so that adding
    one adds no field here. This base is a family with no switches."""

    def check_split(self, tensor_parallel_size: int, expert_parallel: bool) -> None:
        """ValueError, at start, where the family's own sizes do not split over the
        ranks (ParallelConfig.check_model asks it after the sizes every model has)."""

    def latent_cache_dim(self) -> int:
        """The numbers a token's latent vector holds where the family caches one a layer
        (multi-head latent attention: DeepSeek's), else 0 (keys and values a kv head)."""
        return 0

    def keeps_state(self, index: int) -> bool:
        """Whether layer `index` keeps a recurrent state: those that have no KV cache
        instead (RECURRENT_SPEC), unless the family says otherwise (a layer may attend
        beside its recurrence: Falcon-H1's)."""
        return self.kv_spec(index, 0) == RECURRENT_SPEC

    def kv_spec(self, index: int, sliding_window: int) -> tuple[str, int]:
        """Layer `index`'s attention as the KV cache groups it: ("sliding", window) or
        ("chunked", chunk) where its queries see only recent keys, RECURRENT_SPEC where
        the layer keeps a recurrent state instead, else ("full", 0). A family without
        its own kinds has the model's window on every layer."""
        return ("sliding", sliding_window) if sliding_window else ("full", 0)


_Family = TypeVar("_Family", bound=FamilyConfig)


@dataclass
class ModelConfig:
    """What the model runner needs of a checkpoint's config. The model class that runs
    the architecture reads it (models/registry.py finds the class), from a config.json or
    a GGUF file's metadata, with the values common to all (rope, special tokens) read
    by the loader (loader/hf_config.py, loader/gguf_model.py)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-6  # RMSNorm (Llama family) or LayerNorm (OPT, GPT-2) epsilon
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    sliding_window: int = 0  # attention sees this many last tokens (0: all of them)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"  # the MLP's activation ("silu": a gated MLP, as Llama's)
    quantization: QuantizationConfig | None = None  # None: float weights
    family: FamilyConfig = FamilyConfig()  # the family's own switches (see FamilyConfig)

    def kv_specs(self) -> list[tuple[str, int]]:
        """Every layer's attention kind for the KV cache (FamilyConfig.kv_spec)."""
        return [self.family.kv_spec(i, self.sliding_window) for i in range(self.num_layers)]

    def state_layers(self) -> list[int]:
        """The layers that keep a recurrent state (FamilyConfig.keeps_state)."""
        return [i for i in range(self.num_layers) if self.family.keeps_state(i)]

    def has_recurrent_layers(self) -> bool:
        """Whether some layers keep a recurrent state (a hybrid model's Gated DeltaNet
        or Mamba-2 layers)."""
        return bool(self.state_layers())

    def __post_init__(self) -> None:
        """Values a model cannot run with are refused when loaded, not at the first
        request (or, worse, run into NaN)."""
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                    "num_heads", "num_kv_heads", "head_size",
                    "max_position_embeddings")  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not is_real(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not is_int(self.sliding_window) or self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window!r}")
        _check_rope_scaling(self.rope_scaling)

    def family_config(self, kind: type[_Family]) -> _Family:
        """The family's switches, as the model class of that family reads them; a config
        made without any (the base FamilyConfig) has the family's defaults."""
        if isinstance(self.family, kind):
            return self.family
        if type(self.family) is FamilyConfig:
            return kind()
        raise TypeError(
            f"the config of {self.architecture} carries {type(self.family).__name__}, "
            f"not the {kind.__name__} its model reads"
        )


# rope_scaling types and the positive numbers each needs ("freq_divisors": a GGUF's
# rope_freqs tensor, see loader/gguf_model.py).
_ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "freq_divisors": (),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("factor", "original_max_position_embeddings"),
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
    if kind == "longrope":  # (each a list of a factor per frequency)
        for key in ("short_factor", "long_factor"):
            values += list(scaling.get(key) or [None])
    for value in values:
        if not is_real(value) or value <= 0:
            raise ValueError(f"rope_scaling {kind!r} needs positive numbers, got {scaling!r:.120}")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError("rope_scaling 'llama3': high_freq_factor must exceed low_freq_factor")


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


# A cache dtype's torch storage: fp8 e4m3's bytes go as uint8 (the kernels' kFp8Cache).
CACHE_STORAGE = {"fp8_e4m3": "uint8"}
# Bytes an int8 cache's head dims are longer by: each token's float32 scale per kv head
# (cpp/src/kernels/float_convert.h, kInt8ScaleBytes).
INT8_SCALE_BYTES = 4


def kv_cache_dtype_supported(kv_cache_dtype: str, dtype: str, device: str) -> bool:
    """A KV cache in the model's dtype anywhere; a 16-bit, fp8 (e4m3) or int8 (a scale per
    token and head) one under float32 weights on the CPU, whose kernels read it as
    float32; an fp8 or int8 one under 16-bit weights on CUDA."""
    eight_bit = kv_cache_dtype in ("fp8_e4m3", "int8")
    if kv_cache_dtype == dtype:
        return True
    if device == "cpu":
        return dtype == "float32" and (eight_bit or kv_cache_dtype in ("bfloat16", "float16"))
    return eight_bit and dtype in ("bfloat16", "float16")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split: tensor_parallel_size ranks per pipeline stage, and the
    executor whose workers run the ranks, by its name in executor/registry.py ("uni":
    this process, one rank; "mp": a process per rank on this machine; "ray": Ray actors
    across a cluster's nodes), which checks it (check_executor)."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    distributed_executor_backend: str
    # Mixture-of-experts layers: whole experts on each rank (vLLM's
    # enable_expert_parallel), not each expert split over the ranks.
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def check_model(self, c: ModelConfig) -> None:
        """ValueError, at start, where the model does not split this way (as vLLM)."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if c.num_heads % tp:
            raise ValueError(
                f"the model's {c.num_heads} attention heads are not divisible by "
                f"tensor_parallel_size {tp}"
            )
        if c.num_kv_heads % tp and tp % c.num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size {tp} must divide, or be a multiple of, the model's "
                f"{c.num_kv_heads} key/value heads"
            )
        if c.intermediate_size % tp:
            raise ValueError(
                f"the model's intermediate_size {c.intermediate_size} is not divisible by "
                f"tensor_parallel_size {tp}"
            )
        if c.num_layers < pp:
            raise ValueError(
                f"pipeline_parallel_size {pp} exceeds the model's {c.num_layers} layers"
            )
        c.family.check_split(tp, self.enable_expert_parallel)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA (enable_lora): up to max_loras adapters on the model's device at once,
    and in one step; up to max_cpu_loras kept in host memory, the least recently used
    dropped first; ranks up to max_lora_rank."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (not is_int(cpu) or cpu < self.max_loras):
            raise ValueError(
                f"max_cpu_loras must be an integer of at least max_loras ({self.max_loras}), "
                f"got {cpu!r}"
            )

    @property
    def host_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


# How block-quantized CPU layers take a decode step's activations (EngineArgs says).
QUANTIZED_ACTIVATIONS = ("float32", "int8")


# A prompt's last token (a decoder's, which has seen all of it), its first (an
# encoder's [CLS]), or the mean of all of its tokens.
POOLING_TYPES = ("last", "cls", "mean")


@dataclass(frozen=True)
class PoolerConfig:
    """How the pooling runner turns a prompt into its output. `task` is what the model
    gives: "embed" (its pooled states) or "classify" (its classifier's logits, one per
    label; a one-label classifier is a cross-encoder, which scores). With
    `classifier_from_tokens` a decoder classifies by its LM head's logits of these tokens;
    two of them (no, yes) give one logit, yes - no, whose sigmoid is softmax(no, yes)'s
    yes: one label."""

    pooling_type: str
    task: str
    num_labels: int = 0  # a classifier's (0 for an embedder)
    classifier_from_tokens: tuple[int, ...] = ()
    normalize: bool = True  # an embedding's default (a request may say otherwise)

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}"
            )
        if self.task not in ("embed", "classify"):
            raise ValueError(f"a pooling model embeds or classifies, not {self.task!r}")
        if self.classifier_from_tokens and self.pooling_type != "last":
            raise ValueError("classifier_from_token scores a decoder's last token: pooling 'last'")


SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class EngineConfig:
    """The engine's limits, resolved: EngineArgs (which holds every default) makes it."""

    max_model_len: int
    block_size: int
    kv_cache_memory: int  # bytes of CPU KV cache
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    seed: int
    device: str  # "cpu" or "cuda[:N]"
    dtype: str  # of the weights and activations
    kv_cache_dtype: str | None  # None: dtype; else as kv_cache_dtype_supported says
    gpu_memory_utilization: float  # on CUDA: the share of the device's memory to use
    enforce_eager: bool  # decode steps eagerly: no CUDA graphs, no recorded CPU steps
    max_logprobs: int  # the most logprobs / prompt_logprobs a request may ask for
    parallel: ParallelConfig
    quantized_activations: str = "float32"  # one of QUANTIZED_ACTIVATIONS (EngineArgs says)
    lora: LoRAConfig | None = None  # None: no adapters (enable_lora=False)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # A draft model's token, against a one-token step of the target (draft_token_cost):
    # with the verifying row's cost, what a draft costs a step (the draft budget's).
    draft_token_cost: float = 0.0
    # "fcfs", or "priority": waiting requests by their priority (lower first), then
    # arrival; preemption takes the last in that order
    scheduling_policy: str = "fcfs"
    # The KV cache's host tier, bytes per worker (0: none): prefix-cache blocks evicted
    # from the device pool go there, and with preemption_mode "swap" preempted requests.
    kv_offload_bytes: int = 0
    kv_offload_dir: str | None = None  # on the CPU: the tier in a file in this folder
    preemption_mode: str = "recompute"  # one of PREEMPTION_MODES
    # Hybrid models: recurrent states checkpointed every this many blocks for prefix hits
    state_checkpoint_interval: int = 1
    # runner "pooling": how prompts become embeddings or scores (None: the generating
    # runner). Its prompts run whole, one step each, and end there.
    pooler: PoolerConfig | None = None

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
            "scheduling_policy": self.scheduling_policy in SCHEDULING_POLICIES,
            "quantized_activations": self.quantized_activations in QUANTIZED_ACTIVATIONS,
            "kv_offload_bytes": self.kv_offload_bytes >= 0,
            "preemption_mode": self.preemption_mode in PREEMPTION_MODES,
            "state_checkpoint_interval": isinstance(self.state_checkpoint_interval, int)
            and self.state_checkpoint_interval >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name}: invalid value {getattr(self, name)!r}")
        self._check_host_tier()
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len}) without chunked prefill"
            )

    def _check_host_tier(self) -> None:
        if self.preemption_mode == "swap" and self.kv_offload_bytes == 0:
            raise ValueError(
                "preemption_mode 'swap' swaps requests out to the KV cache's host tier: set "
                "kv_offload_gb too"
            )
        directory = self.kv_offload_dir
        if directory is None:
            return
        if self.kv_offload_bytes == 0:
            raise ValueError("kv_offload_dir holds the host tier: set kv_offload_gb (its size)")
        if self.device != "cpu":
            raise ValueError(
                f"kv_offload_dir: the host tier lives in a file on the CPU only (device "
                f"{self.device!r} keeps it in pinned memory)"
            )
        if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
            raise ValueError(f"kv_offload_dir {directory!r} is not a writable folder")
