"""The Llama family (Llama 2/3, SmolLM2, Mistral) and Qwen2/Qwen3, which differ from it
only in q/k/v biases (Qwen2) and per-head q/k RMSNorm (Qwen3).

The step's tokens are one flat batch [num_tokens, hidden]: no padding, no per-request
loop; attention goes through the paged KV cache. q/k/v and gate/up are each one matmul.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from pyengine import ops
from pyengine.config import ModelConfig
from pyengine.layers.attention import AttentionMetadata, KVCache, PagedAttention
from pyengine.layers.block_quantized import BlockQuantized
from pyengine.layers.linear import DenseWeight, GatedDense, Placement, parameter, prepare_dense
from pyengine.layers.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            out = torch.empty_like(x)
            ops.rms_norm(out, x, self.weight, self.eps)
            return out
        variance = x.pow(2).mean(-1, keepdim=True)  # per head (Qwen3's q/k norm)
        return self.weight * (x * torch.rsqrt(variance + self.eps))

    def add_residual(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        """In place: residual += x; x = norm(residual)."""
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.qkv_weight = parameter(self.q_size + 2 * self.kv_size, c.hidden_size)
        self.qkv_bias = parameter(self.q_size + 2 * self.kv_size) if c.attention_bias else None
        self.o_weight = parameter(c.hidden_size, self.q_size)
        self.qkv: DenseWeight  # from qkv_weight and o_weight, once loaded
        self.o: DenseWeight
        self.q_norm = RMSNorm(self.head_dim, c.norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, c.norm_eps) if c.qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(self.heads, self.kv_heads, self.head_dim, c.sliding_window)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv(x, self.qkv_bias)
        q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.heads, self.head_dim)
        k = k.view(-1, self.kv_heads, self.head_dim)
        v = v.view(-1, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        self.rotary(positions, q, k)
        out = self.attn(q, k, v, cache, meta)
        return self.o(out.view(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.intermediate = c.intermediate_size
        self.gate_up_weight = parameter(2 * c.intermediate_size, c.hidden_size)
        self.down_weight = parameter(c.hidden_size, c.intermediate_size)
        self.gate_up: GatedDense  # from the weights above, once loaded
        self.down: DenseWeight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.self_attn = Attention(c, rotary)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.mlp = MLP(c)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added)."""
        if residual is None:  # the first layer: the stream is the embeddings
            residual = h
            h = self.input_layernorm(h)
        else:
            self.input_layernorm.add_residual(h, residual)
        h = self.self_attn(h, positions, cache, meta)
        self.post_attention_layernorm.add_residual(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, config: ModelConfig, max_positions: int, placement: Placement | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.placement = placement or Placement()
        rotary = RotaryEmbedding(
            config.head_dim,
            max_positions,
            config.rope_theta,
            config.rope_scaling,
            self.placement.device,
        )
        self.embed_tokens = parameter(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(config, rotary) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.head: DenseWeight  # from lm_head (or the embeddings), once loaded
        self.num_parameters = 0
        self.lm_head = (
            self.embed_tokens if config.tie_word_embeddings else parameter(*self.embed_tokens.shape)
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # int [num_tokens]
        positions: torch.Tensor,  # int [num_tokens]
        caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] before the final norm."""
        h = F.embedding(input_ids, self.embed_tokens)
        residual: torch.Tensor | None = None
        for layer, cache in zip(self.layers, caches, strict=True):
            h, residual = layer(h, residual, positions, cache, meta)
        return h if residual is None else residual + h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden))

    def load_weights(
        self,
        weights: dict[str, torch.Tensor],
        block_quantized: Mapping[str, BlockQuantized] | None = None,
    ) -> None:
        """Copies Hugging Face-named tensors in, fusing q/k/v and gate/up. `block_quantized`:
        the block form of some of them (GGUF's), fused the same way where every part has
        one."""
        expected = set()
        names = {id(p): n for n, p in self.named_parameters()}
        block_parts: dict[str, list[tuple[int, BlockQuantized]]] = {}
        with torch.no_grad():
            for name, tensor in weights.items():
                target, rows = self._target(name)
                if target is None:
                    continue  # rotary caches and the like
                expected.add(name)
                view = target if rows is None else target[rows[0] : rows[1]]
                if view.shape != tensor.shape:
                    raise ValueError(
                        f"weight {name}: shape {tuple(tensor.shape)}, model expects "
                        f"{tuple(view.shape)}"
                    )
                view.copy_(tensor)
                if block_quantized and name in block_quantized:
                    first = 0 if rows is None else rows[0]
                    block_parts.setdefault(names[id(target)], []).append(
                        (first, block_quantized[name])
                    )
        required = self._required_names()
        missing = sorted(required - expected)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
        fused = {}
        for param, parts in block_parts.items():
            parts.sort(key=lambda part: part[0])
            whole = BlockQuantized.stack([blocks for _, blocks in parts])
            if whole.shape == tuple(self.get_parameter(param).shape):  # every part has one
                fused[param] = whole
        self.prepare_for_inference(fused)

    def prepare_for_inference(
        self, block_quantized: Mapping[str, BlockQuantized] | None = None
    ) -> None:
        """After the weights are in: matmul weights as DenseWeights (from their block form
        too where `block_quantized`, by parameter name, has one)."""
        names = {}
        for i in range(self.config.num_hidden_layers):
            for param, attribute in (
                ("self_attn.qkv_weight", "qkv"), ("self_attn.o_weight", "o"),
                ("mlp.gate_up_weight", "gate_up"), ("mlp.down_weight", "down"),
            ):  # fmt: skip
                names[f"layers.{i}.{param}"] = attribute
        gated = frozenset(f"layers.{i}.mlp.gate_up_weight" for i in range(len(self.layers)))
        self.num_parameters = prepare_dense(
            self, names, self.config.tie_word_embeddings, self.placement, gated, block_quantized
        )

    def _target(self, name: str) -> tuple[torch.Tensor | None, tuple[int, int] | None]:
        if name == "model.embed_tokens.weight":
            return self.embed_tokens, None
        if name == "model.norm.weight":
            return self.norm.weight, None
        if name == "lm_head.weight":
            return (None, None) if self.config.tie_word_embeddings else (self.lm_head, None)
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"]:
            return None, None
        if not parts[2].isdigit() or int(parts[2]) >= len(self.layers):
            raise ValueError(
                f"weight {name}: the model has layers 0 to {len(self.layers) - 1} "
                "(num_hidden_layers)"
            )
        layer = self.layers[int(parts[2])]
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        q, kv = attn.q_size, attn.kv_size
        inter = mlp.intermediate
        module, kind = ".".join(parts[3:-1]), parts[-1]
        fused = {
            "self_attn.q_proj": (attn.qkv_weight, attn.qkv_bias, (0, q)),
            "self_attn.k_proj": (attn.qkv_weight, attn.qkv_bias, (q, q + kv)),
            "self_attn.v_proj": (attn.qkv_weight, attn.qkv_bias, (q + kv, q + 2 * kv)),
            "mlp.gate_proj": (mlp.gate_up_weight, None, (0, inter)),
            "mlp.up_proj": (mlp.gate_up_weight, None, (inter, 2 * inter)),
        }
        if module in fused:
            weight, bias, rows = fused[module]
            if kind not in ("weight", "bias") or (kind == "bias" and bias is None):
                raise ValueError(
                    f"weight {name}: this model has no such tensor (a bias the config does "
                    "not declare, or a quantized checkpoint's scale)"
                )
            return (weight if kind == "weight" else bias), rows
        plain = {
            "self_attn.o_proj.weight": attn.o_weight,
            "mlp.down_proj.weight": mlp.down_weight,
            "input_layernorm.weight": layer.input_layernorm.weight,
            "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
            "self_attn.q_norm.weight": None if attn.q_norm is None else attn.q_norm.weight,
            "self_attn.k_norm.weight": None if attn.k_norm is None else attn.k_norm.weight,
        }
        return plain.get(f"{module}.{kind}"), None

    def _required_names(self) -> set[str]:
        c = self.config
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not c.tie_word_embeddings:
            names.add("lm_head.weight")
        per_layer = [
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
            "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
        ]  # fmt: skip
        if c.attention_bias:
            per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        if c.qk_norm:
            per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        for i in range(c.num_hidden_layers):
            names.update(f"model.layers.{i}.{n}" for n in per_layer)
        return names
