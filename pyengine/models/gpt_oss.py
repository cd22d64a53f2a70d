"""gpt-oss (GptOssForCausalLM) on the Llama family's layers, with what it does otherwise:

- attention with biases on q/k/v and on its output, a learned sink logit per head (a
  share of the softmax that adds no value: PagedAttention.sinks), and 128-token sliding
  windows on the layers `layer_types` names beside full ones;
- YaRN rotary scaling (layers/rotary.py);
- a mixture of experts in every layer (layers/moe): a router with a bias, softmax over
  its top k's logits, experts with biases on both products and the clamped SwiGLU
  (`swiglu_alpha`, `swiglu_limit`). Its checkpoints hold every expert of a layer in one
  tensor, transposed, the gate's and up's columns alternating: `mlp.experts.gate_up_proj`
  [experts, hidden, 2 n], `gate_up_proj_bias` [experts, 2 n], `down_proj` [experts, n,
  hidden], `down_proj_bias` [experts, hidden]; each rank reads its experts' slices.

The sliding layers are a KV-cache group of their own (worker/kv_layout.py), whose blocks
past the window are released. The CUDA kernels' sinks have run in the host emulation
only. The released checkpoints' experts are MXFP4 (`<proj>_blocks` and `<proj>_scales`,
layers/quantization/mxfp4.py): on the CPU in float32 they stay 8-bit blocks of the same
values, elsewhere they are dequantized at load.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from pyengine.config import ModelConfig
from pyengine.layers.block_quantized import BLOCK
from pyengine.layers.layernorm import RMSNorm
from pyengine.layers.linear import LayerContext
from pyengine.layers.moe.activation import ExpertActivation
from pyengine.layers.moe.layer import FusedMoE
from pyengine.layers.moe.methods import experts_method
from pyengine.layers.moe.routing import RoutingConfig
from pyengine.layers.quantization.mxfp4 import dequantize_mxfp4, mxfp4_blocks
from pyengine.layers.quantization.shards import copy_checked
from pyengine.layers.rotary import RotaryEmbedding
from pyengine.models.checkpoint_config import (
    CommonValues,
    GGUFArchitecture,
    GGUFMetadata,
    hf_values_from_gguf,
    integer,
)
from pyengine.models.gemma import layer_types
from pyengine.models.llama import (
    _GGUF_GLOBAL_TENSORS,
    Attention,
    DecoderLayer,
    LlamaFamilyConfig,
    LlamaForCausalLM,
    _config_from_hf,
    _Variant,
)
from pyengine.models.llama import _GGUF_LAYER_TENSORS as _LLAMA_GGUF_LAYER_TENSORS
from pyengine.models.llama_moe import (
    gguf_expert_tensors,
    refuse_adapters,
    route_stacked_experts,
)
from pyengine.models.weights import WeightRouter
from pyengine.utils.lazy_weights import CheckpointTensor, materialize


@dataclass(frozen=True)
class GptOssFamilyConfig(LlamaFamilyConfig):
    num_experts: int = 0
    top_k: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


def _gpt_oss_config_from_hf(raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
    config = _config_from_hf(raw, common, _Variant(attention_bias=True))
    types = layer_types(raw, config.num_layers)
    family = GptOssFamilyConfig(
        attention_bias=bool(raw.get("attention_bias", True)),
        num_experts=integer(raw["num_local_experts"]),
        top_k=integer(raw["num_experts_per_tok"]),
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        window=integer(raw.get("sliding_window") or 0),
        sliding_layers=tuple(i for i, kind in enumerate(types) if kind == "sliding_attention"),
    )
    return replace(config, family=family)


def _gpt_oss_config_from_gguf(m: GGUFMetadata, common: CommonValues) -> ModelConfig:
    """llama.cpp's gpt-oss keys, as the config.json they were converted from says them:
    windows on every other layer from the first (its pattern of 2), YaRN untruncated (as
    gpt-oss's config has it), the clamped SwiGLU's limit where the file gives one."""
    field = m.field
    scaling = common.rope_scaling
    raw = {
        **hf_values_from_gguf(m),
        "intermediate_size": integer(field("expert_feed_forward_length")),
        "head_dim": integer(field("attention.key_length")),
        "num_local_experts": integer(field("expert_count")),
        "num_experts_per_tok": integer(field("expert_used_count")),
        "sliding_window": integer(field("attention.sliding_window", 0)),
        "swiglu_limit": float(field("swiglu_clamp_exp", 7.0)),
    }
    if scaling is not None and scaling.get("rope_type") == "yarn":
        scaling = {**scaling, "truncate": False}
    return _gpt_oss_config_from_hf(raw, replace(common, rope_scaling=scaling))


# llama.cpp's gpt-oss tensors and the family's: the sinks and the router as leaves of
# their own, the experts a tensor per part for every expert (MXFP4 blocks, or floats),
# each with its bias.
_GGUF_LAYER_TENSORS = {
    **{name: hf for name, hf in _LLAMA_GGUF_LAYER_TENSORS.items() if name.startswith("attn_")},
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks.weight": "self_attn.sinks",
    **gguf_expert_tensors(router="router", shared=None),
}
_GGUF_ARCHITECTURES = (
    GGUFArchitecture(
        "gpt-oss", "GptOssForCausalLM", _gpt_oss_config_from_gguf, _GGUF_GLOBAL_TENSORS,
        _GGUF_LAYER_TENSORS, "model.layers",
    ),
)  # fmt: skip


class SinkAttention(Attention):
    """Attention with an output bias and a sink logit per head (this rank's heads)."""

    def __init__(
        self, c: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, prefix: str,
        sliding_window: int,
    ) -> None:  # fmt: skip
        super().__init__(c, rotary, ctx, prefix, sliding_window=sliding_window, output_bias=True)
        self.first_head = self.qkv_proj.shard_offsets[0][0] // c.head_size
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.device = ctx.placement.device  # (where the kernels read the sinks)

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        self.attn.sinks = self.sinks.data.float().contiguous().to(self.device)


class GptOssDecoderLayer(DecoderLayer):
    def __init__(
        self, c: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, index: int
    ) -> None:
        nn.Module.__init__(self)
        family = c.family_config(GptOssFamilyConfig)
        prefix = f"model.layers.{index}"
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        window = family.layer_window(index)
        self.self_attn = SinkAttention(c, rotary, ctx, f"{prefix}.self_attn", window)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        routing = RoutingConfig("softmax", family.top_k, family.num_experts, renormalize=True)
        activation = ExpertActivation("clamped_swiglu", family.swiglu_alpha, family.swiglu_limit)
        # (MXFP4 experts, or a GGUF file's blocks, kept where the placement multiplies
        # blocks, else floats)
        stacked = {f"{prefix}.mlp.experts.{part}.weight" for part in ("gate_proj", "up_proj",
                                                                      "down_proj")}  # fmt: skip
        blocks = c.quantization is not None or stacked <= ctx.linear_methods.block_quantized
        method = experts_method(ctx.placement, blocks=blocks)
        self.mlp = FusedMoE(  # type: ignore[assignment]  # (its forward is an MLP's)
            c.hidden_size, c.intermediate_size, routing, ctx.placement, tp=ctx.tp,
            expert_parallel=ctx.expert_parallel, method=method,
            activation=activation, expert_bias=True, router_bias=True,
        )  # fmt: skip


class GptOssForCausalLM(LlamaForCausalLM):
    hf_architectures: ClassVar[tuple[str, ...]] = ("GptOssForCausalLM",)
    gguf_architectures: ClassVar[tuple[GGUFArchitecture, ...]] = _GGUF_ARCHITECTURES

    @classmethod
    def config_from_hf(cls, raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
        return _gpt_oss_config_from_hf(raw, common)

    def __init__(
        self, config: ModelConfig, max_positions: int, ctx: LayerContext | None = None
    ) -> None:
        refuse_adapters(ctx)
        if config.quantization is not None and config.quantization.method != "mxfp4":
            raise ValueError(
                f"gpt-oss with {config.quantization.describe()} weights is not supported "
                "(float and its released mxfp4 checkpoints are)"
            )
        super().__init__(config, max_positions, ctx)

    def make_layer(
        self, config: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, index: int
    ) -> nn.Module:
        return GptOssDecoderLayer(config, rotary, ctx, index)

    def weight_router(self) -> WeightRouter:
        router = super().weight_router()
        for i in range(self.start_layer, self.end_layer):
            attn = self.layers[i].self_attn
            assert isinstance(attn, SinkAttention)
            name = f"model.layers.{i}.self_attn.sinks"
            router.shard(name, attn.sinks.data, 0, attn.first_head, self.config.num_heads)
        return router

    def route_mlp(self, router: WeightRouter, prefix: str, mlp: nn.Module) -> None:
        assert isinstance(mlp, FusedMoE)
        assert mlp.router_bias is not None and mlp.gate_up_bias is not None
        assert mlp.down_bias is not None
        router.plain(f"{prefix}.router.weight", mlp.router)
        router.plain(f"{prefix}.router.bias", mlp.router_bias)
        s, n = mlp.shard, mlp.intermediate_size
        experts, whole, hidden = (
            mlp.routing.num_experts,
            mlp.full_intermediate_size,
            mlp.hidden_size,
        )

        def mine(tensor: CheckpointTensor) -> torch.Tensor:
            """This rank's experts' gate and up entries along the last dim (alternating)."""
            last = len(tensor.shape) - 1
            return materialize(tensor.narrow(0, s.first, s.count).narrow(last, 2 * s.start, 2 * n))

        def gate_up(name: str, tensor: CheckpointTensor) -> None:
            both = mine(tensor)  # [count, hidden, 2 n]
            copy_checked(name, mlp.gate_up[:, :n], both[..., 0::2].transpose(1, 2))
            copy_checked(name, mlp.gate_up[:, n:], both[..., 1::2].transpose(1, 2))

        def gate_up_bias(name: str, tensor: CheckpointTensor) -> None:
            both = mine(tensor)  # [count, 2 n]
            assert mlp.gate_up_bias is not None
            copy_checked(name, mlp.gate_up_bias[:, :n], both[:, 0::2])
            copy_checked(name, mlp.gate_up_bias[:, n:], both[:, 1::2])

        def down(name: str, tensor: CheckpointTensor) -> None:
            mine = tensor.narrow(0, s.first, s.count).narrow(1, s.start, n)  # [count, n, hidden]
            copy_checked(name, mlp.down, materialize(mine).transpose(1, 2))

        down_bias = functools.partial(_copy_bias_rows, into=mlp.down_bias, first=s.first,
                                      count=s.count, start=0)  # fmt: skip
        for name, shape, load in (
            ("gate_up_proj_bias", (experts, 2 * whole), gate_up_bias),
            ("down_proj_bias", (experts, hidden), down_bias),
        ):
            router.tensor(f"{prefix}.experts.{name}", shape, load)
        if self.config.quantization is not None:
            route_mxfp4_experts(router, f"{prefix}.experts", mlp)
            return
        gguf = route_gguf_experts(router, f"{prefix}.experts", mlp)
        hf = [f"{prefix}.experts.{name}" for name in ("gate_up_proj_bias", "down_proj_bias")]
        if not mlp.method.keeps_blocks:  # (a GGUF file's blocks have no other form)
            router.tensor(f"{prefix}.experts.gate_up_proj", (experts, hidden, 2 * whole), gate_up)
            router.tensor(f"{prefix}.experts.down_proj", (experts, whole, hidden), down)
            hf += [f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"]
        router.either(gguf, hf)


def route_gguf_experts(router: WeightRouter, prefix: str, mlp: FusedMoE) -> list[str]:
    """A GGUF file's experts: a tensor per part for every expert (llama.cpp's gate and up
    apart, in blocks or floats), each with its bias; returns the routes' names."""
    s, n = mlp.shard, mlp.intermediate_size
    names = route_stacked_experts(router, prefix, mlp)
    assert mlp.gate_up_bias is not None and mlp.down_bias is not None
    whole, experts = mlp.full_intermediate_size, mlp.routing.num_experts
    for name, into in (
        ("gate_proj", mlp.gate_up_bias[:, :n]),
        ("up_proj", mlp.gate_up_bias[:, n:]),
    ):
        names.append(f"{prefix}.{name}.bias")
        router.tensor(names[-1], (experts, whole), functools.partial(
            _copy_bias_rows, into=into, first=s.first, count=s.count, start=s.start))  # fmt: skip
    names.append(f"{prefix}.down_proj.bias")
    router.tensor(names[-1], (experts, mlp.hidden_size), functools.partial(
        _copy_bias_rows, into=mlp.down_bias, first=s.first, count=s.count, start=0))  # fmt: skip
    return names


def _copy_bias_rows(
    name: str, tensor: CheckpointTensor, *, into: torch.Tensor, first: int, count: int,
    start: int,
) -> None:  # fmt: skip
    """This rank's experts' biases [first, first + count), columns from `start`."""
    mine = tensor.narrow(0, first, count).narrow(1, start, into.shape[1])
    copy_checked(name, into, mine)


def route_mxfp4_experts(router: WeightRouter, prefix: str, mlp: FusedMoE) -> None:
    """The experts' MXFP4 `gate_up_proj` (its gate and up rows alternating) and
    `down_proj` (blocks and scales, which come apart: each weight is taken once both have
    loaded), this rank's experts and rows of them: as 8-bit blocks where the layer keeps
    blocks, else dequantized into its float weights."""
    s, n = mlp.shard, mlp.intermediate_size
    experts, whole, hidden = mlp.routing.num_experts, mlp.full_intermediate_size, mlp.hidden_size
    if s.start % BLOCK or n % BLOCK:
        raise ValueError(
            f"mxfp4 experts: a rank's {n} intermediate features from {s.start} split the "
            f"down projection's blocks of {BLOCK}"
        )
    pending: dict[str, dict[str, torch.Tensor]] = {"gate_up_proj": {}, "down_proj": {}}

    def take(proj: str) -> None:
        blocks, scales = pending[proj]["blocks"], pending[proj]["scales"]
        if mlp.method.keeps_blocks:
            for e in range(s.count):
                b = mxfp4_blocks(blocks[e].numpy(), scales[e].numpy())
                if proj == "down_proj":
                    mlp.expert_blocks[e, "down"] = b
                else:
                    mlp.expert_blocks[e, "gate"] = b.map_rows(lambda a: a[0::2])
                    mlp.expert_blocks[e, "up"] = b.map_rows(lambda a: a[1::2])
            return
        weights = dequantize_mxfp4(blocks, scales)  # [count, rows, cols]
        if proj == "down_proj":
            copy_checked(f"{prefix}.down_proj", mlp.down, weights)
        else:
            copy_checked(f"{prefix}.gate_up_proj", mlp.gate_up[:, :n], weights[:, 0::2])
            copy_checked(f"{prefix}.gate_up_proj", mlp.gate_up[:, n:], weights[:, 1::2])

    def part(proj: str, kind: str) -> Callable[[str, CheckpointTensor], None]:
        def load(name: str, tensor: CheckpointTensor) -> None:
            mine = tensor.narrow(0, s.first, s.count)
            if proj == "gate_up_proj":  # (rows: this rank's gate and up rows, alternating)
                mine = mine.narrow(1, 2 * s.start, 2 * n)
            else:  # (columns: its intermediate features' blocks)
                mine = mine.narrow(2, s.start // BLOCK, n // BLOCK)
            held = materialize(mine)
            if held.dtype != torch.uint8:
                raise ValueError(f"weight {name}: mxfp4 {kind} are uint8, got {held.dtype}")
            pending[proj][kind] = held
            if len(pending[proj]) == 2:
                take(proj)
                pending[proj] = {}

        return load

    for proj, rows, columns in (("gate_up_proj", 2 * whole, hidden), ("down_proj", hidden, whole)):
        groups = -(-columns // BLOCK)
        router.tensor(f"{prefix}.{proj}_blocks", (experts, rows, groups, BLOCK // 2),
                      part(proj, "blocks"))  # fmt: skip
        router.tensor(f"{prefix}.{proj}_scales", (experts, rows, groups), part(proj, "scales"))
