"""Mixtures of experts on the Llama family's attention: Qwen3-MoE (Qwen3's per-head q/k
RMSNorm; experts in the layers `decoder_sparse_step` and `mlp_only_layers` say, renormalised
where `norm_topk_prob` says), Qwen2-MoE (Qwen2's attention, its q/k/v biases as
`qkv_bias` says; the same layers as Qwen3-MoE, and a shared expert each, scaled by a
sigmoid gate), Mixtral (Mistral's attention; experts in every layer, always
renormalised) and OLMoE (q/k RMSNorms over each whole projection, q, k and v clamped by
`clip_qkv`; experts in every layer, renormalised where `norm_topk_prob` says). Their
experts are a FusedMoE layer (layers/moe), softmax top-k routed; checkpoints name each
expert's weights, as transformers writes them (Qwen3-MoE: `mlp.experts.N.gate_proj`,
Mixtral: `block_sparse_moe.experts.N.w1`, w3 the up and w2 the down projection), or
hold every expert in one tensor, as transformers 5 holds them (`mlp.experts.gate_up_proj`
and `mlp.experts.down_proj`, under `mlp` in every family).

A quantized checkpoint's experts (GPTQ, AWQ, compressed-tensors) are linear layers of its
method, an expert at a time (layers/moe/linear_experts.py). Over tensor-parallel ranks
the experts are split by their intermediate size, or with expert parallelism placed
whole on the ranks (FusedMoE). LoRA adapters on the experts are refused by name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

from torch import nn

from pyengine.config import ModelConfig
from pyengine.layers.linear import LayerContext
from pyengine.layers.moe.layer import FusedMoE
from pyengine.layers.moe.linear_experts import ExpertLinears, quantized_experts_method
from pyengine.layers.moe.methods import experts_method
from pyengine.layers.moe.routing import RoutingConfig
from pyengine.layers.quantization.shards import copy_checked
from pyengine.models.checkpoint_config import (
    CommonValues,
    GGUFArchitecture,
    GGUFMetadata,
    integer,
)
from pyengine.models.llama import (
    _GGUF_GLOBAL_TENSORS,
    _GGUF_LAYER_TENSORS,
    DecoderLayer,
    LlamaFamilyConfig,
    LlamaForCausalLM,
    _config_from_gguf,
    _config_from_hf,
    _Variant,
)
from pyengine.models.weights import WeightRouter


@dataclass(frozen=True)
class MoeFamilyConfig(LlamaFamilyConfig):
    """The experts: how many, how many a token takes, their size, whether their weights
    are renormalised, which layers have them, and their checkpoint names (the layer's
    module, and its gate, up and down projections')."""

    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()
    moe_module: str = "mlp"
    expert_parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared: SharedNames | None = None
    # The routing (layers/moe/routing.py): its method, groups, scale and whether a
    # correction bias steers its choice (DeepSeek's; the others' softmax by default).
    routing_method: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    scaling_factor: float = 1.0
    choice_bias: bool = False

    def routing(self) -> RoutingConfig:
        return RoutingConfig(
            self.routing_method, self.top_k, self.num_experts, self.norm_topk_prob,
            self.num_groups, self.topk_groups, self.scaling_factor,
        )  # fmt: skip

    def check_split(self, tensor_parallel_size: int, expert_parallel: bool) -> None:
        splits = [("shared expert's intermediate size", self.shared_intermediate_size)]
        if expert_parallel:
            splits.append(("num_experts", self.num_experts))
        else:
            splits.append(("experts' intermediate size", self.moe_intermediate_size))
        for name, size in splits:
            if size % tensor_parallel_size:
                how = " with expert parallelism" if expert_parallel else ""
                raise ValueError(
                    f"the model's {name} ({size}) is not divisible by tensor_parallel_size "
                    f"{tensor_parallel_size}{how}"
                )


@dataclass(frozen=True)
class SharedNames:
    """A shared expert's config key and checkpoint names: its intermediate size's key,
    its module, and its gate's module (None: ungated)."""

    size_key: str
    module: str
    gate: str | None


@dataclass(frozen=True)
class SharedGateNames:
    """The checkpoint names of a shared expert's gate, by form (none: no gated one)."""

    hf: tuple[str, ...] = ()
    gguf: tuple[str, ...] = ()


@dataclass(frozen=True)
class _MoeVariant:
    """How one Hugging Face architecture reads its config.json and names its experts."""

    attention: _Variant
    expert_size_key: str  # the config's key of an expert's intermediate size
    moe_module: str
    expert_parts: tuple[str, str, str]
    renormalize: bool | None = None  # None: as the config's norm_topk_prob says
    bias_key: str = "attention_bias"  # the config's key of the q/k/v biases
    shared: SharedNames | None = None


_QWEN2_SHARED = SharedNames("shared_expert_intermediate_size", "shared_expert",
                            "shared_expert_gate")  # fmt: skip
_MOE_VARIANTS = {
    "Qwen3MoeForCausalLM": _MoeVariant(
        _Variant(qk_norm=True), "moe_intermediate_size", "mlp",
        ("gate_proj", "up_proj", "down_proj"),
    ),
    "Qwen2MoeForCausalLM": _MoeVariant(
        _Variant(attention_bias=True), "moe_intermediate_size", "mlp",
        ("gate_proj", "up_proj", "down_proj"), bias_key="qkv_bias", shared=_QWEN2_SHARED,
    ),
    "MixtralForCausalLM": _MoeVariant(
        _Variant(sliding_window=True), "intermediate_size", "block_sparse_moe", ("w1", "w3", "w2"),
        renormalize=True,
    ),
    # (its q and k norms over each whole projection; q, k and v clamped by clip_qkv)
    "OlmoeForCausalLM": _MoeVariant(
        _Variant(qk_norm=True, qk_norm_whole=True), "intermediate_size", "mlp",
        ("gate_proj", "up_proj", "down_proj"),
    ),
}  # fmt: skip


def sparse_layers(raw: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers with experts, as transformers' families say: every
    decoder_sparse_step-th (counting from 1; Qwen2/3-MoE), but those mlp_only_layers
    names, and none of the first first_k_dense_replace (DeepSeek's), then every
    moe_layer_freq-th (counting from 0)."""
    step = integer(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    first = integer(raw.get("first_k_dense_replace", 0))
    frequency = integer(raw.get("moe_layer_freq", 1))
    return tuple(
        i for i in range(num_layers)
        if i not in dense and step > 0 and (i + 1) % step == 0
        and i >= first and frequency > 0 and i % frequency == 0
    )  # fmt: skip


# Whether each GGUF architecture renormalises its top k's weights where the file does not
# say (expert_weights_norm): Qwen3-MoE's checkpoints do, Qwen2-MoE's (Qwen1.5-MoE) do not,
# Mixtral's (llama.cpp's llama with experts) always do.
_GGUF_NORM_TOPK = {"qwen3moe": True, "qwen2moe": False, "llama": True}


def _moe_config_from_gguf(m: GGUFMetadata, common: CommonValues) -> ModelConfig:
    """llama.cpp's keys: its attention's as the Llama family reads them, and the experts'
    count, top k and size; the layers with experts are those with a router tensor, a
    shared expert where the file has its tensors (Qwen2-MoE's, gated)."""
    config = _config_from_gguf(m, common)
    sparse = tuple(
        i for i in range(config.num_layers) if f"blk.{i}.ffn_gate_inp.weight" in m.tensor_names
    )
    shared = any(f"blk.{i}.ffn_gate_shexp.weight" in m.tensor_names for i in sparse)
    norm = m.fields.get(f"{m.architecture}.expert_weights_norm", _GGUF_NORM_TOPK[m.architecture])
    family = MoeFamilyConfig(
        **asdict(config.family_config(LlamaFamilyConfig)),
        num_experts=int(m.field("expert_count")),
        top_k=int(m.field("expert_used_count")),
        # (Mixtral's experts are feed_forward_length wide: llama.cpp writes no other)
        moe_intermediate_size=int(
            m.field("expert_feed_forward_length", m.field("feed_forward_length"))
        ),
        norm_topk_prob=bool(norm),
        sparse_layers=sparse,
        shared_intermediate_size=int(m.field("expert_shared_feed_forward_length")) if shared else 0,
        shared=_QWEN2_SHARED if shared else None,
    )  # fmt: skip
    return replace(config, family=family)


def gguf_expert_tensors(
    module: str = "mlp", router: str = "gate", shared: str | None = "shared_expert"
) -> dict[str, str]:
    """A GGUF file's experts: every expert of a layer in a tensor per part (blocks along
    the hidden size for gate and up, along the expert's size for down), the router, and
    a shared expert's parts (where the family has one, under `shared`), by the names the
    layer's routes give them under `module`."""
    parts = ("gate", "up", "down")
    names = {f"ffn_{p}_exps": f"{module}.experts.{p}_proj" for p in parts}
    names["ffn_gate_inp"] = f"{module}.{router}"
    if shared is not None:
        names.update({f"ffn_{p}_shexp": f"{module}.{shared}.{p}_proj" for p in parts})
    return names


_GGUF_EXPERT_TENSORS = {
    **gguf_expert_tensors(),
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate_1d",  # ([hidden]; Hugging Face's [1, hidden])
}


def _has_experts(m: GGUFMetadata) -> bool:
    return int(m.fields.get(f"{m.architecture}.expert_count", 0) or 0) > 0


# (Mixtral is llama.cpp's llama with experts: its attention's q/k rows permuted as Llama's)
_GGUF_ARCHITECTURES = tuple(
    GGUFArchitecture(
        name, hf_architecture, _moe_config_from_gguf, _GGUF_GLOBAL_TENSORS,
        {**_GGUF_LAYER_TENSORS, **_GGUF_EXPERT_TENSORS}, "model.layers",
        rope_permuted=name == "llama", holds=_has_experts if name == "llama" else None,
    )
    for name, hf_architecture in (("qwen2moe", "Qwen2MoeForCausalLM"),
                                  ("qwen3moe", "Qwen3MoeForCausalLM"),
                                  ("llama", "MixtralForCausalLM"))
)  # fmt: skip


def route_expert_linears(
    router: WeightRouter, experts: str, mlp: FusedMoE, parts: Sequence[str]
) -> None:
    """A quantized checkpoint's experts, an expert at a time: each local expert's linear
    layers, `parts` under `{experts}.{expert}`."""
    assert mlp.experts is not None
    for expert, linears in zip(mlp.local_experts(), mlp.experts, strict=True):
        assert isinstance(linears, ExpertLinears)
        linears.route(router, [f"{experts}.{expert}.{part}" for part in parts])


def route_stacked_experts(router: WeightRouter, experts: str, mlp: FusedMoE) -> list[str]:
    """A GGUF file's experts: a tensor per part for every expert (`{experts}.gate_proj.
    weight`...), in blocks where the layer keeps them, else floats; the routes' names."""
    names = []
    for name, stack in mlp.stacked_tensors().items():
        names.append(f"{experts}.{name}.weight")
        router.tensor(names[-1], stack.shape, stack.floats,
                      stack.blocks if mlp.method.keeps_blocks else None)  # fmt: skip
    return names


def refuse_adapters(ctx: LayerContext | None) -> None:
    """LoRA adapters on mixture-of-experts layers: refused by name, at start."""
    if ctx is not None and ctx.adapters:
        raise ValueError("LoRA adapters on mixture-of-experts layers are not supported")


class LlamaMoeForCausalLM(LlamaForCausalLM):
    hf_architectures: ClassVar[tuple[str, ...]] = tuple(_MOE_VARIANTS)
    gguf_architectures: ClassVar[tuple[GGUFArchitecture, ...]] = _GGUF_ARCHITECTURES

    @classmethod
    def config_from_hf(cls, raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
        variant = _MOE_VARIANTS[common.architecture]
        config = _config_from_hf(raw, common, variant.attention)
        renormalize = variant.renormalize
        if renormalize is None:
            renormalize = bool(raw.get("norm_topk_prob", False))
        # (transformers 5 writes num_local_experts; earlier ones, and Qwen's, num_experts)
        experts = raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"]
        attention = asdict(config.family_config(LlamaFamilyConfig))
        attention["attention_bias"] = bool(
            raw.get(variant.bias_key, variant.attention.attention_bias)
        )
        shared = variant.shared
        family = MoeFamilyConfig(
            **attention,
            num_experts=integer(experts),
            top_k=integer(raw["num_experts_per_tok"]),
            moe_intermediate_size=integer(raw[variant.expert_size_key]),
            norm_topk_prob=renormalize,
            sparse_layers=sparse_layers(raw, config.num_layers),
            moe_module=variant.moe_module,
            expert_parts=variant.expert_parts,
            shared_intermediate_size=integer(raw[shared.size_key]) if shared else 0,
            shared=shared,
        )  # fmt: skip
        return replace(config, family=family)

    def __init__(
        self, config: ModelConfig, max_positions: int, ctx: LayerContext | None = None
    ) -> None:
        ctx = ctx or LayerContext()
        refuse_adapters(ctx)
        super().__init__(config, max_positions, ctx)
        moe = config.family_config(MoeFamilyConfig)
        routing = moe.routing()
        int8_activations = ctx.quantized_activations == "int8"
        gated = moe.shared is not None and moe.shared.gate is not None
        for i in moe.sparse_layers:
            layer = self.layers[i]
            if isinstance(layer, DecoderLayer):  # (this stage's)
                stacked = [f"model.layers.{i}.mlp.experts.{part}.weight"
                           for part in ("gate_proj", "up_proj", "down_proj")]  # fmt: skip
                blocks = set(stacked) <= ctx.linear_methods.block_quantized
                experts = FusedMoE(
                    config.hidden_size, moe.moe_intermediate_size, routing, ctx.placement,
                    moe.shared_intermediate_size, gated, ctx.tp, ctx.expert_parallel,
                    quantized_experts_method(config.quantization, ctx)
                    or experts_method(ctx.placement, blocks, int8_activations),
                    choice_bias=moe.choice_bias,
                )  # fmt: skip
                layer.mlp = experts  # type: ignore[assignment]  # (its forward is an MLP's)

    def route_mlp(self, router: WeightRouter, prefix: str, mlp: nn.Module) -> None:
        if not isinstance(mlp, FusedMoE):
            super().route_mlp(router, prefix, mlp)
            return
        family = self.config.family_config(MoeFamilyConfig)
        module = f"{prefix.removesuffix('.mlp')}.{family.moe_module}"
        if mlp.choice_bias is not None:
            router.plain(f"{module}.gate.e_score_correction_bias", mlp.choice_bias)
        # The shared expert: its parts named alike in every form, its gate not.
        gates = self.route_shared_expert(router, module, mlp, family)
        if mlp.experts is not None:  # a quantized checkpoint's: an expert at a time
            router.plain(f"{module}.gate.weight", mlp.router)
            route_expert_linears(router, f"{module}.experts", mlp, family.expert_parts)
            router.either([f"{module}.gate.weight", *gates.hf], list(gates.gguf))
            return
        # A GGUF file's form: a tensor per part for every expert, in blocks or floats.
        stacked = [f"{prefix}.gate.weight", *gates.gguf,
                   *route_stacked_experts(router, f"{prefix}.experts", mlp)]  # fmt: skip
        router.plain(stacked[0], mlp.router)
        if mlp.method.keeps_blocks:
            return  # (the file's blocks: no other form)
        per_expert = [f"{module}.gate.weight", *gates.hf]
        for expert in mlp.local_experts():  # (the other ranks' are theirs to load)
            for name, part in zip(family.expert_parts, mlp.expert_parts(expert), strict=True):
                per_expert.append(f"{module}.experts.{expert}.{name}.weight")
                router.shard(per_expert[-1], *part)
        # Or every expert in one tensor, as transformers 5 names them (under "mlp" in
        # every family).
        fused = [f"{prefix}.gate.weight", *gates.hf]
        for name, (shape, load) in mlp.fused_tensors().items():
            fused.append(f"{prefix}.experts.{name}")
            router.tensor(fused[-1], shape, load)
        router.plain(per_expert[0], mlp.router)
        router.either(per_expert, fused, stacked)

    @staticmethod
    def route_shared_expert(
        router: WeightRouter, module: str, mlp: FusedMoE, family: MoeFamilyConfig
    ) -> SharedGateNames:
        """Routes the shared expert's parts; returns its gate's names in a Hugging Face
        checkpoint ([1, hidden]) and in a GGUF file ([hidden]), each routed."""
        shared, names = mlp.shared_expert, family.shared
        if shared is None or names is None:
            return SharedGateNames()
        shared.route(router, [f"{module}.{names.module}.{name}" for name in family.expert_parts])
        gate = shared.gate
        if gate is None or names.gate is None:
            return SharedGateNames()
        hf, gguf = f"{module}.{names.gate}.weight", f"{module}.{names.gate}_1d.weight"
        if not mlp.method.keeps_blocks:
            router.plain(hf, gate)
        router.tensor(gguf, (gate.shape[1],), lambda name, t: copy_checked(name, gate[0], t))
        return SharedGateNames((hf,), (gguf,))
