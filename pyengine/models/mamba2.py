"""Mamba-2 (Mamba2ForCausalLM): a decoder of state-space layers alone, each a pre-norm
residual block around a Mamba-2 mixer (layers/mamba2_mixer.py). No layer attends, so no
layer has a KV cache: each request's states live in slots (worker/state_pool.py), and
the KV layout keeps one group of no pages (its blocks count a request's tokens only).

The layer (`Mamba2Layer`) is what the Mamba-2 hybrids (Bamba, Granite 4, Nemotron-H,
Falcon-H1) put beside their attention layers: one input projection giving the gate, x,
B, C and the step (a section each, split over the ranks by heads and groups), the short
convolution over x, B and C, the scan, the gated RMSNorm per group, the output
projection."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from pyengine.config import RECURRENT_SPEC, FamilyConfig, ModelConfig
from pyengine.layers.attention import AttentionMetadata, KVCache
from pyengine.layers.layernorm import RMSNorm
from pyengine.layers.linear import LayerContext, MergedColumnParallelLinear, RowParallelLinear
from pyengine.layers.mamba2_mixer import Mamba2Mixer, Mamba2Shape
from pyengine.layers.recurrent_state import (
    RecurrentStates,
    mixer_parameter,
    rank_sections,
)
from pyengine.layers.rotary import RotaryEmbedding
from pyengine.models.checkpoint_config import (
    CommonValues,
    GGUFArchitecture,
    GGUFMetadata,
    hf_values_from_gguf,
    integer,
)
from pyengine.models.llama import DecoderLayer, LlamaForCausalLM
from pyengine.models.weights import WeightRouter


@dataclass(frozen=True)
class MambaSizes:
    """A Mamba-2 layer's whole sizes (config.json's names)."""

    heads: int = 0
    head_dim: int = 0
    groups: int = 0
    state_size: int = 0
    conv_width: int = 4
    conv_bias: bool = True
    bias: bool = False  # the input projection's bias (and the output's, unless out_bias)
    out_bias: bool | None = None  # the output projection's (None: as bias)
    dt_min: float = 0.0  # time_step_limit
    dt_max: float = float("inf")


@dataclass(frozen=True)
class Mamba2FamilyConfig(FamilyConfig):
    mamba: MambaSizes = MambaSizes()

    def kv_spec(self, index: int, sliding_window: int) -> tuple[str, int]:
        return RECURRENT_SPEC

    def check_split(self, tensor_parallel_size: int, expert_parallel: bool) -> None:
        check_mamba_split(self.mamba, tensor_parallel_size)


def check_mamba_split(sizes: MambaSizes, tensor_parallel_size: int) -> None:
    """The heads and the groups of B and C are split over the ranks."""
    for name, count in (("mamba heads", sizes.heads), ("n_groups", sizes.groups)):
        if count % tensor_parallel_size:
            raise ValueError(
                f"the model's {name} ({count}) is not divisible by tensor_parallel_size "
                f"{tensor_parallel_size}"
            )


def _json_float(value: Any) -> float:
    """A number of a config.json, where transformers 5 writes infinity as
    {"__float__": "Infinity"}."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    return float(value)


# Mamba2ForCausalLM's config.json keys of its layers' sizes, and the hybrids' (Bamba,
# Granite 4, Falcon-H1), in MambaSizes' order.
MAMBA2_KEYS = ("num_heads", "head_dim", "n_groups", "state_size", "conv_kernel",
               "use_conv_bias", "use_bias")  # fmt: skip
HYBRID_KEYS = ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state",
               "mamba_d_conv", "mamba_conv_bias", "mamba_proj_bias")  # fmt: skip


def mamba_sizes(raw: Mapping[str, Any], inner: int, keys: tuple[str, ...]) -> MambaSizes:
    """A config.json's Mamba-2 sizes under `keys` (MAMBA2_KEYS or HYBRID_KEYS), whose
    heads make `inner` numbers (a head size of "auto": inner over the heads)."""
    heads_key, head_key, groups_key, state_key, conv_key, conv_bias_key, bias_key = keys
    limit = raw.get("time_step_limit") or (0.0, float("inf"))
    heads = integer(raw[heads_key])
    head_dim = raw.get(head_key, "auto")
    if head_dim in ("auto", None) and heads > 0:
        head_dim = inner // heads
    sizes = MambaSizes(
        heads=heads,
        head_dim=integer(head_dim),
        groups=integer(raw[groups_key]),
        state_size=integer(raw[state_key]),
        conv_width=integer(raw.get(conv_key, 4)),
        conv_bias=bool(raw.get(conv_bias_key, True)),
        bias=bool(raw.get(bias_key, False)),
        dt_min=_json_float(limit[0]),
        dt_max=_json_float(limit[1]),
    )
    for name in ("heads", "head_dim", "groups", "state_size", "conv_width"):
        if getattr(sizes, name) < 1:
            raise ValueError(f"the Mamba-2 layers' {name} must be positive, got {sizes}")
    if sizes.heads % sizes.groups:
        raise ValueError(f"mamba heads ({sizes.heads}) must be a multiple of n_groups "
                         f"({sizes.groups})")  # fmt: skip
    if inner != sizes.heads * sizes.head_dim:
        raise ValueError(
            f"the Mamba-2 layers' inner size ({inner}) must equal their heads times their "
            f"head size ({sizes.heads} * {sizes.head_dim})"
        )
    return sizes


def gguf_mamba_tensors(module: str) -> dict[str, str]:
    """A Mamba-2 layer's tensors in a GGUF file (llama.cpp's mamba2 and its hybrids), by
    the names of the layer's module: A and D without a suffix."""
    names = {"ssm_in": "in_proj", "ssm_conv1d": "conv1d", "ssm_dt.bias": "dt_bias",
             "ssm_a": "A_log", "ssm_d": "D", "ssm_norm": "norm", "ssm_out": "out_proj"}  # fmt: skip
    return {part: f"{module}.{name}" for part, name in names.items()}


def mamba_values_to_hf(name: str, values: np.ndarray, config: ModelConfig) -> np.ndarray:
    """A Mamba-2 layer's tensor as the Hugging Face checkpoint holds it, where llama.cpp's
    conversion changed it (a GGUFArchitecture's to_hf): A stored as -exp(A_log) [heads,
    1] (its log taken back in float64), D as [heads, 1], the norm's weight as [groups,
    inner / groups]. (The convolution's [channels, width], squeezed, loads as it is.)"""
    if name.endswith(".A_log"):
        return np.log(-values.astype(np.float64)).astype(np.float32).reshape(-1)
    if name.endswith((".D", ".norm.weight")):
        return values.reshape(-1)
    return values


def gguf_mamba_sizes(
    m: GGUFMetadata, layer: int, keys: tuple[str, ...] = MAMBA2_KEYS
) -> dict[str, Any]:
    """A Mamba-2 layer's sizes from a GGUF file's ssm.* keys, under `keys` (MAMBA2_KEYS or
    HYBRID_KEYS), the biases from the tensors of layer `layer` (one of the model's
    Mamba-2 layers)."""
    inner, heads = integer(m.field("ssm.inner_size")), integer(m.field("ssm.time_step_rank"))
    if heads < 1 or inner % heads:
        raise ValueError(f"ssm.inner_size {inner} does not split into {heads} heads")
    values = (
        heads, inner // heads, integer(m.field("ssm.group_count", 1)),
        integer(m.field("ssm.state_size")), integer(m.field("ssm.conv_kernel")),
        f"blk.{layer}.ssm_conv1d.bias" in m.tensor_names,
        f"blk.{layer}.ssm_in.bias" in m.tensor_names,
    )  # fmt: skip
    return dict(zip(keys, values, strict=True))


class Mamba2Layer(nn.Module):
    """A Mamba-2 mixer with its projections and parameters (a StateLayer: the model
    runner hands it its slots' tensors as its cache)."""

    def __init__(
        self, hidden_size: int, sizes: MambaSizes, eps: float, ctx: LayerContext, prefix: str,
        norm: str = "after_gate",
    ) -> None:  # fmt: skip
        super().__init__()
        tp = ctx.tp
        world = tp.world_size
        self.shape = Mamba2Shape(
            sizes.heads // world, sizes.head_dim, sizes.groups // world, sizes.state_size,
            sizes.conv_width, eps, sizes.dt_min, sizes.dt_max, norm,  # type: ignore[arg-type]
        )  # fmt: skip
        inner, groups = sizes.heads * sizes.head_dim, sizes.groups * sizes.state_size
        # (one checkpoint tensor of five sections: the gate, x, B, C and the step)
        self.in_proj = MergedColumnParallelLinear(
            hidden_size, [inner, inner, groups, groups, sizes.heads], sizes.bias, ctx,
            [f"{prefix}.in_proj.weight"],
        )  # fmt: skip
        out_bias = sizes.bias if sizes.out_bias is None else sizes.out_bias
        self.out_proj = RowParallelLinear(
            inner, hidden_size, out_bias, ctx, [f"{prefix}.out_proj.weight"]
        )
        s, device = self.shape, ctx.placement.device
        self.conv_sections = rank_sections((inner, groups, groups), tp)
        self.heads = (tp.rank * s.heads, sizes.heads)  # (this rank's first, of all)
        self.conv_weight = mixer_parameter(s.conv_channels, s.conv_width, device=device)
        self.conv_bias = (mixer_parameter(s.conv_channels, device=device)
                          if sizes.conv_bias else None)  # fmt: skip
        self.A_log, self.D, self.dt_bias = (
            mixer_parameter(s.heads, device=device) for _ in range(3)
        )
        self.norm_weight = mixer_parameter(s.inner, device=device)
        self.mixer: Mamba2Mixer | None = None
        self.state_index = 0  # (the model runner's to set)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        s = self.shape
        return (s.conv_channels, s.conv_width - 1), (s.heads, s.head_dim, s.state_size)

    def process_weights_after_loading(self) -> None:
        bias = self.conv_bias.data if self.conv_bias is not None else None
        self.mixer = Mamba2Mixer(
            self.shape, self.conv_weight.data, bias, self.A_log.data, self.D.data,
            self.dt_bias.data, self.norm_weight.data,
        )  # fmt: skip

    def route(self, router: WeightRouter, prefix: str) -> None:
        """Its checkpoint tensors, under `prefix` (the layer's mixer)."""
        router.fused(f"{prefix}.in_proj.weight", self.in_proj, "weight")
        router.linear_weight(f"{prefix}.out_proj", self.out_proj)
        if self.in_proj.bias is not None:
            router.fused(f"{prefix}.in_proj.bias", self.in_proj, "bias")
        if self.out_proj.bias is not None:
            router.linear(f"{prefix}.out_proj.bias", self.out_proj, "bias")
        router.sections(f"{prefix}.conv1d.weight", self.conv_weight.data, self.conv_sections)
        if self.conv_bias is not None:
            router.sections(f"{prefix}.conv1d.bias", self.conv_bias.data, self.conv_sections)
        for name in ("A_log", "D", "dt_bias"):
            router.shard(f"{prefix}.{name}", getattr(self, name).data, 0, *self.heads)
        inner = self.conv_sections[0]
        if self.shape.norm != "none":  # (Falcon-H1's mixer may have no norm)
            router.shard(f"{prefix}.norm.weight", self.norm_weight.data, 0, inner[1], inner[0])

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        """(`cache`: the layer's KV cache, which it does not read; its states are the
        step's)"""
        assert self.mixer is not None, "process_weights_after_loading makes the mixer"
        del positions, cache  # (a recurrence knows its order)
        states = RecurrentStates.of_step(meta, self.state_index)
        out: torch.Tensor = self.out_proj(self.mixer(self.in_proj(x), states).to(x.dtype))
        return out


class Mamba2Block(DecoderLayer):
    """A pre-norm residual block around a Mamba-2 layer (no MLP)."""

    norms: ClassVar[tuple[str, ...]] = ("norm",)

    def __init__(self, c: ModelConfig, ctx: LayerContext, prefix: str) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        sizes = c.family_config(Mamba2FamilyConfig).mamba
        self.mixer = Mamba2Layer(c.hidden_size, sizes, c.norm_eps, ctx, f"{prefix}.mixer")

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
        cache: KVCache, meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        h, residual = self.enter(h, residual)
        return self.mixer(h, positions, cache, meta), residual


def _config_from_hf(raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
    hidden = integer(raw["hidden_size"])
    inner = integer(raw.get("inner_size") or int(float(raw.get("expand", 2)) * hidden))
    sizes = mamba_sizes(raw, inner, MAMBA2_KEYS)
    return ModelConfig(
        architecture=common.architecture,
        vocab_size=integer(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=inner,
        num_layers=integer(raw["num_hidden_layers"]),
        # (no attention: the heads are the mixers', which split over the ranks alike)
        num_heads=sizes.heads,
        num_kv_heads=sizes.heads,
        head_size=sizes.head_dim,
        # (no positions to embed: the longest context is the engine's to choose)
        max_position_embeddings=integer(raw.get("max_position_embeddings", 4096)),
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=common.bos_token_id,
        eos_token_ids=common.eos_token_ids,
        family=Mamba2FamilyConfig(mamba=sizes),
    )


# llama.cpp writes a context of 2**20 (no limit) for Mamba-2, whose Hugging Face configs
# name none: read as 4096 there, and so here (max_model_len may not pass it).
_NO_CONTEXT = 2**20


def _config_from_gguf(m: GGUFMetadata, common: CommonValues) -> ModelConfig:
    """llama.cpp's mamba2 keys as the config.json they came from says them."""
    common_values = hf_values_from_gguf(m)
    context = common_values["max_position_embeddings"]
    raw = {
        **common_values, **gguf_mamba_sizes(m, 0),
        "inner_size": integer(m.field("ssm.inner_size")),
        "layer_norm_epsilon": common_values["rms_norm_eps"],
        "max_position_embeddings": 4096 if context >= _NO_CONTEXT else context,
    }  # fmt: skip
    return _config_from_hf(raw, common)


_GGUF_ARCHITECTURES = (
    GGUFArchitecture(
        "mamba2", "Mamba2ForCausalLM", _config_from_gguf,
        {"token_embd.weight": "backbone.embeddings.weight",
         "output_norm.weight": "backbone.norm_f.weight", "output.weight": "lm_head.weight"},
        {"attn_norm": "norm", **gguf_mamba_tensors("mixer")}, "backbone.layers",
        to_hf=mamba_values_to_hf,
    ),
)  # fmt: skip


class Mamba2ForCausalLM(LlamaForCausalLM):
    hf_architectures: ClassVar[tuple[str, ...]] = ("Mamba2ForCausalLM",)
    gguf_architectures: ClassVar[tuple[GGUFArchitecture, ...]] = _GGUF_ARCHITECTURES

    @classmethod
    def config_from_hf(cls, raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
        return _config_from_hf(raw, common)

    def make_rotary(self, config: ModelConfig, max_positions: int) -> RotaryEmbedding:
        """(no layer attends: a placeholder of one position, which no layer turns)"""
        return RotaryEmbedding(2, 1, config.rope_theta, None, self.placement.device)

    def make_layer(
        self, config: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, index: int
    ) -> nn.Module:
        return Mamba2Block(config, ctx, f"backbone.layers.{index}")

    def weight_router(self) -> WeightRouter:
        """Mamba-2's checkpoint names (backbone.embeddings, backbone.layers.N.norm and
        .mixer, backbone.norm_f, lm_head)."""
        c = self.config
        router = WeightRouter(c.num_layers, "backbone.layers.", (self.start_layer, self.end_layer))
        self.route_vocab(router, "backbone.embeddings.weight", "lm_head.weight")
        if self.norm is not None:
            router.plain("backbone.norm_f.weight", self.norm.weight)
        for i in range(self.start_layer, self.end_layer):
            layer = self.layers[i]
            assert isinstance(layer, Mamba2Block)
            router.plain(f"backbone.layers.{i}.norm.weight", layer.input_layernorm.weight)
            layer.mixer.route(router, f"backbone.layers.{i}.mixer")
        return router
