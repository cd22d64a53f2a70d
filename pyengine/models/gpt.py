"""Decoders with learned absolute positions, LayerNorm and biases everywhere: OPT and
GPT-2. Same flat batch and paged attention as the Llama family; no rotary embedding."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pyengine.config import ModelConfig
from pyengine.layers.attention import AttentionMetadata, KVCache, PagedAttention
from pyengine.layers.linear import DenseWeight, Placement, parameter, prepare_dense

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class _Linear(nn.Module):
    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = parameter(out_features, in_features)
        self.bias = parameter(out_features)
        self.dense: DenseWeight  # from weight, once loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x, self.bias)


class _LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = parameter(size)
        self.bias = parameter(size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class _Layer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.hidden, self.heads, self.head_dim = c.hidden_size, c.num_attention_heads, c.head_dim
        self.norm1 = _LayerNorm(c.hidden_size, c.norm_eps)
        self.qkv = _Linear(3 * c.hidden_size, c.hidden_size)
        self.out = _Linear(c.hidden_size, c.hidden_size)
        self.norm2 = _LayerNorm(c.hidden_size, c.norm_eps)
        self.fc1 = _Linear(c.intermediate_size, c.hidden_size)
        self.fc2 = _Linear(c.hidden_size, c.intermediate_size)
        if c.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"activation {c.hidden_act!r} is not supported")
        self.act = _ACTIVATIONS[c.hidden_act]
        self.norm_before = c.norm_before
        self.attn = PagedAttention(c.num_attention_heads, c.num_attention_heads, c.head_dim)

    def _attention(self, x: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv.dense(x, self.qkv.bias).view(-1, 3, self.heads, self.head_dim).unbind(1)
        return self.out.dense(self.attn(q, k, v, cache, meta).view(-1, self.hidden), self.out.bias)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.fc1.dense(x, self.fc1.bias))
        return self.fc2.dense(hidden, self.fc2.bias)

    def forward(self, h: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        if self.norm_before:
            h = h + self._attention(self.norm1(h), cache, meta)
            return h + self._mlp(self.norm2(h))
        h = self.norm1(h + self._attention(h, cache, meta))
        out: torch.Tensor = self.norm2(h + self._mlp(h))
        return out


# Hugging Face name (outside the layers) -> internal parameter name.
_OPT_GLOBAL = {
    "embed_tokens.weight": "embed_tokens",
    "embed_positions.weight": "embed_positions",
    "final_layer_norm.weight": "final_norm.weight",
    "final_layer_norm.bias": "final_norm.bias",
    "lm_head.weight": "lm_head",
}
_GPT2_GLOBAL = {
    "wte.weight": "embed_tokens",
    "wpe.weight": "embed_positions",
    "ln_f.weight": "final_norm.weight",
    "ln_f.bias": "final_norm.bias",
    "lm_head.weight": "lm_head",
}
# Hugging Face layer module -> (internal module, rows of the fused q/k/v or None).
_OPT_LAYER = {
    "self_attn.q_proj": ("qkv", 0),
    "self_attn.k_proj": ("qkv", 1),
    "self_attn.v_proj": ("qkv", 2),
    "self_attn.out_proj": ("out", None),
    "self_attn_layer_norm": ("norm1", None),
    "final_layer_norm": ("norm2", None),
    "fc1": ("fc1", None),
    "fc2": ("fc2", None),
}
_GPT2_LAYER = {
    "ln_1": "norm1",
    "attn.c_attn": "qkv",
    "attn.c_proj": "out",
    "ln_2": "norm2",
    "mlp.c_fc": "fc1",
    "mlp.c_proj": "fc2",
}
# (internal parameter name, rows of a fused q/k/v or None), the tensor; None: not a weight.
_Target = tuple[tuple[str, int | None], torch.Tensor] | None

_GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # stored [in, out]


class LearnedPositionDecoder(nn.Module):
    def __init__(self, config: ModelConfig, placement: Placement | None = None) -> None:
        super().__init__()
        self.config = config
        self.placement = placement or Placement()
        c = config
        self.embed_tokens = parameter(c.vocab_size, c.hidden_size)
        self.embed_positions = parameter(
            c.max_position_embeddings + c.position_offset, c.hidden_size
        )
        self.layers = nn.ModuleList([_Layer(c) for _ in range(c.num_hidden_layers)])
        # OPT-350m (post-LN) has no final norm; every pre-LN model has one.
        self.final_norm = _LayerNorm(c.hidden_size, c.norm_eps) if c.norm_before else None
        self.lm_head = (
            self.embed_tokens if c.tie_word_embeddings else parameter(*self.embed_tokens.shape)
        )
        self.head: DenseWeight  # from lm_head (or the embeddings), once loaded
        self.num_parameters = 0

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed_tokens) + F.embedding(
            positions + self.config.position_offset, self.embed_positions
        )
        for layer, cache in zip(self.layers, caches, strict=True):
            h = layer(h, cache, meta)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        return self.head(hidden)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        loaded: set[tuple[str, int | None]] = set()
        with torch.no_grad():
            for name, tensor in weights.items():
                target = self._target(name, tensor)
                if target is None:
                    continue
                (internal, rows), value = target
                try:
                    param = self.get_parameter(internal)
                except AttributeError:  # a layer past the last, say
                    raise ValueError(f"weight {name}: the model has no such tensor") from None
                view = param if rows is None else param.view(3, -1, *param.shape[1:])[rows]
                if view.shape != value.shape:
                    raise ValueError(
                        f"weight {name}: shape {tuple(value.shape)}, model expects "
                        f"{tuple(view.shape)}"
                    )
                view.copy_(value)
                loaded.add((internal, rows))
        missing = sorted(
            f"{internal}{'' if rows is None else f'[{rows}]'}"
            for internal, rows in self._required()
            if (internal, rows) not in loaded
        )
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
        self.prepare_for_inference()

    def prepare_for_inference(self) -> None:
        """After the weights are in: matmul weights as DenseWeights."""
        names = {
            f"layers.{i}.{n}.weight": "dense"
            for i in range(self.config.num_hidden_layers)
            for n in ("qkv", "out", "fc1", "fc2")
        }
        self.num_parameters = prepare_dense(
            self, names, self.config.tie_word_embeddings, self.placement
        )

    def _required(self) -> list[tuple[str, int | None]]:
        fused = self.config.architecture == "OPTForCausalLM"
        required: list[tuple[str, int | None]] = []
        for name, _ in self.named_parameters():
            if name == "lm_head" and self.config.tie_word_embeddings:
                continue
            if fused and ".qkv." in name:
                required += [(name, k) for k in range(3)]
            else:
                required.append((name, None))
        return required

    def _target(self, name: str, tensor: torch.Tensor) -> _Target:
        opt = self.config.architecture == "OPTForCausalLM"
        if opt:
            name = name.removeprefix("model.").removeprefix("decoder.")
        else:
            name = name.removeprefix("transformer.")
        outside_layers = _OPT_GLOBAL if opt else _GPT2_GLOBAL
        if name in outside_layers:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                return None
            return (outside_layers[name], None), tensor
        if opt:
            return self._opt_layer_target(name, tensor)
        return self._gpt2_layer_target(name, tensor)

    def _opt_layer_target(self, name: str, tensor: torch.Tensor) -> _Target:
        m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", name)
        if not m or m.group(2) not in _OPT_LAYER:
            return None
        internal, rows = _OPT_LAYER[m.group(2)]
        return (f"layers.{m.group(1)}.{internal}.{m.group(3)}", rows), tensor

    def _gpt2_layer_target(self, name: str, tensor: torch.Tensor) -> _Target:
        m = re.fullmatch(r"h\.(\d+)\.(.+)\.(weight|bias)", name)
        if not m or m.group(2) not in _GPT2_LAYER:
            return None  # attn.bias / masked_bias buffers of old checkpoints
        if m.group(2) in _GPT2_CONV1D and m.group(3) == "weight":
            tensor = tensor.t()
        return (f"layers.{m.group(1)}.{_GPT2_LAYER[m.group(2)]}.{m.group(3)}", None), tensor
