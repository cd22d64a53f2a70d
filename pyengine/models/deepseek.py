"""DeepSeek-V2 and V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): multi-head latent
attention (MLA) beside a mixture of experts with shared experts.

Attention: a token's keys and values come from one latent vector, the kv_lora_rank
numbers of `kv_a_proj_with_mqa`'s output RMS-normed (c_kv), beside its last
qk_rope_head_dim numbers rotated (k_pe, one for every head). The KV cache holds only
that vector a token and layer (ModelRunner: a latent cache, whole on every rank). The
queries come from `q_proj`, or through the low rank `q_a_proj`, its norm and `q_b_proj`;
each head's first qk_nope_head_dim numbers are taken into the latent space by the key
half of `kv_b_proj` (the absorbed form), its last rotated, and attend over the cached
latents (layers/latent_attention.py); the output leaves the latent space by the value
half of `kv_b_proj`, then `o_proj`. A request with many query tokens in a step (a long
prefill) takes the expanded form instead: its latents turned into per-head keys and
values by `kv_b_proj`, then plain causal attention. The rotary pairs are interleaved
(V3's `rope_interleave`, V2 always); YaRN's mscale_all_dim scales the softmax twice.

Experts: every layer from `first_k_dense_replace` on (every `moe_layer_freq`-th), with
`n_shared_experts` shared experts as one of their summed size. V2 routes by softmax,
limited to its top `topk_group` of `n_group` groups (`group_limited_greedy`); V3 by
sigmoid scores whose choice an `e_score_correction_bias` steers (`noaux_tc`); both scale
the weights by `routed_scaling_factor`. Quantized checkpoints (V3's own FP8 blocks, the
fp8 quant_method, among them) hold every projection quantized; kv_b_proj is dequantized
once loaded, as the absorbed products read it. The latent kernel runs on the CPU, and on
CUDA (cuda/mla_attention.cu) with PYENGINE_CUDA_MLA=1 until it has run on a GPU.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from pyengine.config import ModelConfig
from pyengine.distributed import TensorParallelGroup
from pyengine.layers.attention import AttentionMetadata, KVCache
from pyengine.layers.latent_attention import (
    ExpandedWeights,
    LatentAttention,
    expanded_attention,
    expanded_head_size,
    long_requests,
    without_requests,
)
from pyengine.layers.layernorm import RMSNorm
from pyengine.layers.linear import ColumnParallelLinear, LayerContext, RowParallelLinear
from pyengine.layers.quantization.shards import copy_checked
from pyengine.layers.rotary import RotaryEmbedding
from pyengine.models.checkpoint_config import (
    CommonValues,
    GGUFArchitecture,
    GGUFMetadata,
    hf_values_from_gguf,
    integer,
)
from pyengine.models.llama import (
    _GGUF_GLOBAL_TENSORS,
    MLP,
    DecoderLayer,
    LlamaFamilyConfig,
    _config_from_hf,
    _Variant,
)
from pyengine.models.llama_moe import (
    LlamaMoeForCausalLM,
    MoeFamilyConfig,
    SharedNames,
    gguf_expert_tensors,
    sparse_layers,
)
from pyengine.models.weights import WeightRouter
from pyengine.utils.lazy_weights import CheckpointTensor, materialize


@dataclass(frozen=True)
class DeepseekFamilyConfig(MoeFamilyConfig):
    q_lora_rank: int = 0  # 0: q_proj whole
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    softmax_scale: float = 0.0

    def latent_cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


_SHARED = SharedNames("n_shared_experts", "shared_experts", None)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0


def _deepseek_config_from_hf(raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
    nope, rope = integer(raw["qk_nope_head_dim"]), integer(raw["qk_rope_head_dim"])
    config = _config_from_hf(raw, common, _Variant())
    scaling = common.rope_scaling or {}
    softmax_scale = (nope + rope) ** -0.5
    if scaling.get("rope_type", scaling.get("type")) == "yarn" and scaling.get("mscale_all_dim"):
        m = _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        softmax_scale *= m * m
    v2 = common.architecture == "DeepseekV2ForCausalLM"
    method = raw.get("topk_method") or ("greedy" if v2 else "noaux_tc")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"topk_method {method!r} is not supported")
    grouped = method != "greedy"
    experts = integer(raw.get("n_routed_experts") or raw.get("num_local_experts"))
    family = DeepseekFamilyConfig(
        **asdict(config.family_config(LlamaFamilyConfig)),
        num_experts=experts,
        top_k=integer(raw["num_experts_per_tok"]),
        moe_intermediate_size=integer(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        sparse_layers=sparse_layers(raw, config.num_layers),
        shared_intermediate_size=integer(raw.get("n_shared_experts") or 0)
        * integer(raw["moe_intermediate_size"]),
        shared=_SHARED if raw.get("n_shared_experts") else None,
        routing_method="grouped_sigmoid" if method == "noaux_tc" else "grouped_softmax",
        num_groups=integer(raw.get("n_group") or 1) if grouped else 1,
        topk_groups=integer(raw.get("topk_group") or 1) if grouped else 1,
        scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        choice_bias=method == "noaux_tc",
        q_lora_rank=integer(raw.get("q_lora_rank") or 0),
        kv_lora_rank=integer(raw["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=integer(raw["v_head_dim"]),
        rope_interleave=True if v2 else bool(raw.get("rope_interleave", True)),
        softmax_scale=softmax_scale,
    )
    # (the rotary part's size: ModelConfig's head size is what the rotary embedding turns)
    return replace(config, head_size=rope, family=family)


def _sigmoid_gating(m: GGUFMetadata) -> bool:
    """(llama.cpp's expert_gating_func 2: V3's sigmoid; 1 or none: softmax)"""
    return integer(m.fields.get(f"{m.architecture}.expert_gating_func") or 1) == 2


def _deepseek_config_from_gguf(m: GGUFMetadata, common: CommonValues) -> ModelConfig:
    """llama.cpp's deepseek2 keys, as the config.json they were converted from says them
    (then read as that is): V3's sigmoid routing where expert_gating_func is 2, groups
    where the file has them (none: llama.cpp's plain top k), and the head sizes of its
    MLA form (key_length_mla, value_length_mla) where it writes them."""
    field = m.field
    rope = integer(field("rope.dimension_count"))
    key = integer(m.fields.get(f"{m.architecture}.attention.key_length_mla")
                  or field("attention.key_length"))  # fmt: skip
    value = integer(m.fields.get(f"{m.architecture}.attention.value_length_mla")
                    or field("attention.value_length"))  # fmt: skip
    groups = integer(m.fields.get(f"{m.architecture}.expert_group_count") or 1)
    sigmoid = _sigmoid_gating(m)
    heads = integer(field("attention.head_count"))
    raw = {
        **hf_values_from_gguf(m),
        "intermediate_size": integer(field("feed_forward_length")),
        "num_key_value_heads": heads,  # (the MLA form's 1 is the latent's)
        "q_lora_rank": integer(m.fields.get(f"{m.architecture}.attention.q_lora_rank") or 0),
        "kv_lora_rank": integer(field("attention.kv_lora_rank")),
        "qk_nope_head_dim": key - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": value,
        "n_routed_experts": integer(field("expert_count")),
        "num_experts_per_tok": integer(field("expert_used_count")),
        "moe_intermediate_size": integer(field("expert_feed_forward_length")),
        "n_shared_experts": integer(field("expert_shared_count", 0)),
        "first_k_dense_replace": integer(field("leading_dense_block_count", 0)),
        "routed_scaling_factor": float(field("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(field("expert_weights_norm", False)),
        "topk_method": "noaux_tc"
        if sigmoid
        else "group_limited_greedy"
        if groups > 1
        else "greedy",
        "n_group": groups,
        "topk_group": integer(m.fields.get(f"{m.architecture}.expert_group_used_count") or 1),
        "rope_interleave": True,
        "rope_scaling": common.rope_scaling,
    }
    return _deepseek_config_from_hf(raw, common)


# llama.cpp's deepseek2 tensors and the family's: attention's low-rank projections and
# norms, kv_b_proj whole (older files) or as attn_k_b [heads, rank, nope] and attn_v_b
# [heads, v, rank] (its MLA form), the experts as the other mixtures' files hold them.
_GGUF_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    **gguf_expert_tensors(shared="shared_experts"),
}


# (one llama.cpp name: V3's where its experts route by sigmoid, else V2's)
_GGUF_ARCHITECTURES = tuple(
    GGUFArchitecture(
        "deepseek2",
        hf,
        _deepseek_config_from_gguf,
        _GGUF_GLOBAL_TENSORS,
        _GGUF_LAYER_TENSORS,
        "model.layers",
        holds=holds,
    )  # fmt: skip
    for hf, holds in (
        ("DeepseekV3ForCausalLM", _sigmoid_gating),
        ("DeepseekV2ForCausalLM", lambda m: not _sigmoid_gating(m)),
    )
)


class LatentAttentionLayer(nn.Module):
    """MLA's projections around LatentAttention: this rank's heads (their q, their part
    of kv_b_proj and o_proj); the latent's projection whole on every rank."""

    def __init__(
        self, c: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, prefix: str
    ) -> None:
        super().__init__()
        f = c.family_config(DeepseekFamilyConfig)
        self.nope, self.rope, self.v = f.qk_nope_head_dim, f.qk_rope_head_dim, f.v_head_dim
        self.rank = f.kv_lora_rank
        qk = self.nope + self.rope
        self.first_head, self.heads = ctx.tp.split(c.num_heads, "num_attention_heads")
        self.placement = ctx.placement
        whole = replace(ctx, tp=TensorParallelGroup())  # (replicated: every rank the same)
        bias = f.attention_bias
        self.q_a_proj: ColumnParallelLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        if f.q_lora_rank:
            self.q_a_proj = ColumnParallelLinear(c.hidden_size, [f.q_lora_rank], bias, whole,
                                                 [f"{prefix}.q_a_proj.weight"])  # fmt: skip
            self.q_a_layernorm = RMSNorm(f.q_lora_rank, c.norm_eps)
        name = "q_b_proj" if f.q_lora_rank else "q_proj"
        self.q_proj = ColumnParallelLinear(f.q_lora_rank or c.hidden_size, [c.num_heads * qk],
                                           False, ctx, [f"{prefix}.{name}.weight"])  # fmt: skip
        self.kv_a_proj_with_mqa = ColumnParallelLinear(
            c.hidden_size, [self.rank + self.rope], bias, whole,
            [f"{prefix}.kv_a_proj_with_mqa.weight"],
        )  # fmt: skip
        self.kv_a_layernorm = RMSNorm(self.rank, c.norm_eps)
        # kv_b_proj's rows of this rank's heads, [heads * (nope + v), rank]: its key half
        # takes the queries into the latent space, its value half the outputs out of it.
        # The absorbed products read it as float: a quantized one is dequantized once
        # loaded (its product with the identity), and the layer dropped.
        self.kv_b_proj: ColumnParallelLinear | None = ColumnParallelLinear(
            self.rank, [c.num_heads * (self.nope + self.v)], False, ctx,
            [f"{prefix}.kv_b_proj.weight"],
        )  # fmt: skip
        self.o_proj = RowParallelLinear(c.num_heads * self.v, c.hidden_size, bias, ctx,
                                        [f"{prefix}.o_proj.weight"])  # fmt: skip
        self.rotary = rotary
        self.attn = LatentAttention(self.heads, self.rank, self.rope, f.softmax_scale)
        self.w_uk = self.w_uv = torch.empty(0)
        # The expanded form's weights, once loaded (None: no paged attention kernel holds
        # its heads, and every step is absorbed).
        self.expanded: ExpandedWeights | None = None

    def process_weights_after_loading(self) -> None:
        """(after kv_b_proj's own, which the model's post-order runs first)"""
        assert self.kv_b_proj is not None
        placement = self.placement
        identity = torch.eye(self.rank, dtype=placement.dtype, device=placement.device)
        kv_b = self.kv_b_proj(identity).t()  # [heads * (nope + v), rank]
        self.kv_b_proj = None
        per_head = kv_b.view(self.heads, self.nope + self.v, self.rank)
        self.w_uk = per_head[:, : self.nope].contiguous()  # [heads, nope, rank]
        self.w_uv = per_head[:, self.nope :].transpose(1, 2).contiguous()  # [heads, rank, v]
        size = expanded_head_size(self.nope + self.rope, self.v)
        if size is not None:
            self.expanded = ExpandedWeights(self.w_uk, self.w_uv, self.attn.scale, size)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        tokens = x.shape[0]
        if self.q_a_proj is not None and self.q_a_layernorm is not None:
            x_q = self.q_a_layernorm(self.q_a_proj(x))
        else:
            x_q = x
        q = self.q_proj(x_q).view(tokens, self.heads, self.nope + self.rope)
        latent = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(latent[:, : self.rank].contiguous())
        q_pe = q[..., self.nope :].contiguous()
        k_pe = latent[:, self.rank :].contiguous().view(tokens, 1, self.rope)
        self.rotary(positions, q_pe, k_pe)
        latents = torch.cat((c_kv, k_pe.view(tokens, self.rope)), dim=-1)
        self.attn.write(latents, cache, meta)
        q_nope = q[..., : self.nope]
        expanded_from = self.attn.expanded_from_over(cache, q.dtype) if self.expanded else None
        long, starts = long_requests(meta, expanded_from) if expanded_from else ([], [])
        if long:
            heads_out = self._expanded(q_nope, q_pe, cache, meta, starts, long)
        else:
            heads_out = self._absorbed(q_nope, q_pe, cache, meta)
        result: torch.Tensor = self.o_proj(heads_out.reshape(tokens, -1))
        return result

    def _expanded(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
        starts: list[int], long: list[int],
    ) -> torch.Tensor:  # fmt: skip
        """The `long` requests' queries (rows [starts[r], starts[r + 1])) through the
        expanded form, the step's others through the absorbed one: [tokens, heads, v]."""
        assert self.expanded is not None  # (else no request is long)
        tokens = q_nope.shape[0]
        heads_out = torch.empty(tokens, self.heads, self.v, dtype=q_nope.dtype,
                                device=q_nope.device)  # fmt: skip
        query = torch.cat((q_nope, q_pe), dim=-1)
        for r in long:
            rows = slice(starts[r], starts[r + 1])
            context = self.attn.context(cache, meta, r)
            heads_out[rows] = expanded_attention(query[rows], context, self.expanded)
        if len(long) < len(starts) - 1:
            rest, index = without_requests(meta, starts, long)
            heads_out[index] = self._absorbed(q_nope[index], q_pe[index], cache, rest)
        return heads_out

    def _absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The queries' heads (their nope and rotated parts) through the absorbed form:
        [tokens, heads, v]."""
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        query = torch.cat((q_latent, q_pe), dim=-1)
        out = self.attn.absorbed(query, cache, meta)
        heads_out = torch.bmm(out.to(self.w_uv.dtype).transpose(0, 1), self.w_uv)  # [heads, T, v]
        return heads_out.transpose(0, 1)


class DeepseekDecoderLayer(DecoderLayer):
    def __init__(
        self, c: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, index: int
    ) -> None:
        nn.Module.__init__(self)
        prefix = f"model.layers.{index}"
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.self_attn = LatentAttentionLayer(c, rotary, ctx, f"{prefix}.self_attn")  # type: ignore[assignment]
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.mlp = MLP(c, ctx, f"{prefix}.mlp")  # (sparse layers' become experts)


class DeepseekForCausalLM(LlamaMoeForCausalLM):
    hf_architectures: ClassVar[tuple[str, ...]] = (
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
    )
    gguf_architectures: ClassVar[tuple[GGUFArchitecture, ...]] = _GGUF_ARCHITECTURES

    @classmethod
    def config_from_hf(cls, raw: Mapping[str, Any], common: CommonValues) -> ModelConfig:
        return _deepseek_config_from_hf(raw, common)

    def __init__(
        self, config: ModelConfig, max_positions: int, ctx: LayerContext | None = None
    ) -> None:
        ctx = ctx or LayerContext()
        device = ctx.placement.device.type
        if device != "cpu" and not (
            device == "cuda" and os.environ.get("PYENGINE_CUDA_MLA") == "1"
        ):
            raise ValueError(
                "DeepSeek's latent attention runs on the CPU; its CUDA kernel "
                "(cuda/mla_attention.cu, tested in the host emulation) is opt-in until it has "
                "run on a GPU: PYENGINE_CUDA_MLA=1"
            )
        super().__init__(config, max_positions, ctx)

    def make_rotary(self, config: ModelConfig, max_positions: int) -> RotaryEmbedding:
        """The rotary part of each head alone (the config's head size), its pairs
        interleaved where V3's rope_interleave says (V2's always are)."""
        family = config.family_config(DeepseekFamilyConfig)
        return RotaryEmbedding(
            config.head_size, max_positions, config.rope_theta, config.rope_scaling,
            self.placement.device, is_neox=not family.rope_interleave,
        )  # fmt: skip

    def make_layer(
        self, config: ModelConfig, rotary: RotaryEmbedding, ctx: LayerContext, index: int
    ) -> nn.Module:
        return DeepseekDecoderLayer(config, rotary, ctx, index)

    def route_attention(self, router: WeightRouter, prefix: str, attn: nn.Module) -> None:
        assert isinstance(attn, LatentAttentionLayer)
        for name, layer in (("q_a_proj", attn.q_a_proj), ("kv_a_proj_with_mqa",
                            attn.kv_a_proj_with_mqa), ("o_proj", attn.o_proj)):  # fmt: skip
            if layer is None:
                continue
            router.linear_weight(f"{prefix}.{name}", layer)
            if layer.bias is not None:
                router.linear(f"{prefix}.{name}.bias", layer, "bias")
        q_name = "q_b_proj" if attn.q_a_proj is not None else "q_proj"
        router.linear_weight(f"{prefix}.{q_name}", attn.q_proj)
        for name, norm in (("q_a_layernorm", attn.q_a_layernorm),
                           ("kv_a_layernorm", attn.kv_a_layernorm)):  # fmt: skip
            if norm is not None:
                self.route_norm(router, f"{prefix}.{name}.weight", norm)
        assert attn.kv_b_proj is not None
        router.linear_weight(f"{prefix}.kv_b_proj", attn.kv_b_proj)
        self.route_split_kv_b(router, prefix, attn)

    def route_split_kv_b(
        self, router: WeightRouter, prefix: str, attn: LatentAttentionLayer
    ) -> None:
        """llama.cpp's MLA form of kv_b_proj: attn_k_b [heads, rank, nope] (each head's key
        rows transposed) and attn_v_b [heads, v, rank], this rank's heads of each into
        kv_b_proj's float weight."""
        heads, first, nope, v, rank = attn.heads, attn.first_head, attn.nope, attn.v, attn.rank
        num_heads = self.config.num_heads

        def rows() -> torch.Tensor:  # [heads, nope + v, rank]
            assert attn.kv_b_proj is not None
            return attn.kv_b_proj.weight.data.view(heads, nope + v, rank)

        def k_b(name: str, tensor: CheckpointTensor) -> None:
            mine = materialize(tensor.narrow(0, first, heads))
            copy_checked(name, rows()[:, :nope], mine.transpose(1, 2))

        def v_b(name: str, tensor: CheckpointTensor) -> None:
            copy_checked(name, rows()[:, nope:], tensor.narrow(0, first, heads))

        router.tensor(f"{prefix}.k_b_proj.weight", (num_heads, rank, nope), k_b)
        router.tensor(f"{prefix}.v_b_proj.weight", (num_heads, v, rank), v_b)
        router.either([f"{prefix}.kv_b_proj.weight"],
                      [f"{prefix}.k_b_proj.weight", f"{prefix}.v_b_proj.weight"])  # fmt: skip
