"""A PEFT LoRA adapter read from its folder and checked against the base model.

adapter_config.json gives r, lora_alpha, use_rslora and target_modules;
adapter_model.safetensors holds, for each adapted projection of decoder layer i,
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` [r, in] and
`lora_B.weight` [out, r]. The delta of a projection is x @ A.T @ B.T * scale, scale =
lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)), applied last, as PEFT does. The
embedding's pair is `model.embed_tokens.lora_embedding_A` [r, vocab] and `_B` [hidden,
r] (x one-hot: A's column of the token), the LM head's `lm_head.lora_A.weight` [r,
hidden] and `lora_B.weight` [vocab, r]; beside them PEFT saves the frozen tables
themselves (`base_layer.weight`), which must be the base model's shape and are not read
(the model's own serve). An adapter is held on the host in float32.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pyengine.config import ModelConfig
from pyengine.lora.request import LoRARequest

# The projections an adapter may target, as PEFT names them in llama-style models.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
# The model's own modules, outside the decoder layers: their deltas' layer index.
VOCAB_MODULES = ("embed_tokens", "lm_head")
MODEL_LAYER = -1
_PREFIX = r"(?:base_model\.model\.)?"
_KEY = re.compile(_PREFIX + r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_VOCAB_KEY = re.compile(
    _PREFIX + r"(?:model\.(embed_tokens)\.lora_embedding_([AB])|(lm_head)\.lora_([AB])\.weight)"
)
_FROZEN_TABLE = re.compile(_PREFIX + r"(?:model\.embed_tokens|lm_head)\.base_layer\.weight")


def projection_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(out, in) of a decoder layer's projection, or of the embedding (in: the
    vocabulary, one-hot) or the LM head."""
    q, kv = config.num_heads * config.head_size, config.num_kv_heads * config.head_size
    hidden, inner, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    return {
        "q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
        "o_proj": (hidden, q), "gate_proj": (inner, hidden), "up_proj": (inner, hidden),
        "down_proj": (hidden, inner), "embed_tokens": (hidden, vocab), "lm_head": (vocab, hidden),
    }[module]  # fmt: skip


@dataclass(frozen=True)
class LoRAWeights:
    """One projection's delta before the adapter's scale: x @ a.T @ b.T."""

    a: torch.Tensor  # float32 [rank, in]
    b: torch.Tensor  # float32 [out, rank]


@dataclass(frozen=True)
class LoRAAdapter:
    request: LoRARequest
    rank: int
    scale: float  # lora_alpha / rank, or / sqrt(rank) (rsLoRA)
    # (decoder layer, module) -> its delta, the embedding's and the LM head's at
    # (MODEL_LAYER, module); modules the adapter leaves out have none.
    weights: dict[tuple[int, str], LoRAWeights]

    def adapts(self, module: str) -> bool:
        """Whether it holds a delta of the model-level `module` (VOCAB_MODULES)."""
        return (MODEL_LAYER, module) in self.weights

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


def _config(folder: Path, name: str) -> dict[str, object]:
    path = folder / "adapter_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"LoRA adapter {name!r}: {path} does not exist") from None
    except (OSError, ValueError) as error:
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a JSON file: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {path} must hold an object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not LORA")
    for flag, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights")):
        if config.get(flag):
            raise ValueError(f"LoRA adapter {name!r}: {why} is not supported")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if config.get(pattern):
            raise ValueError(f"LoRA adapter {name!r}: per-module {pattern} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias {config.get('bias')!r} is not supported")
    return config


def _scale(config: dict[str, object], rank: int, name: str) -> float:
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ValueError(f"LoRA adapter {name!r}: lora_alpha must be a positive number")
    return float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)


class _Tensors:
    """adapter_model.safetensors, opened: its header read (names, shapes), each tensor's
    data only when asked for."""

    def __init__(self, folder: Path, name: str) -> None:
        from safetensors import SafetensorError, safe_open

        self.path, self.name = folder / "adapter_model.safetensors", name
        if not self.path.is_file():
            raise ValueError(f"LoRA adapter {name!r}: {self.path} does not exist")
        try:
            with safe_open(str(self.path), framework="pt") as f:
                names = f.keys()  # noqa: SIM118 (a safe_open is not iterable)
                self.shapes = {key: tuple(f.get_slice(key).get_shape()) for key in names}
        except (SafetensorError, OSError, ValueError) as error:
            raise self.corrupt(error) from None

    def corrupt(self, error: Exception) -> ValueError:
        return ValueError(f"LoRA adapter {self.name!r}: {self.path} is corrupt: {error}")

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.path), framework="pt") as f:
                return {key: f.get_tensor(key) for key in keys}
        except (SafetensorError, OSError, ValueError) as error:
            raise self.corrupt(error) from None


@dataclass(frozen=True)
class _Layout:
    """An adapter's checked form: its rank, scale, and the names of each delta's pair."""

    rank: int
    scale: float
    pairs: dict[tuple[int, str], tuple[str, str]]  # (layer, module) -> (A's, B's)
    tensors: _Tensors


def check_adapter(request: LoRARequest, model: ModelConfig, max_lora_rank: int) -> _Layout:
    """`request`'s adapter checked against the base model `model` from its config and
    the tensors' names and shapes (no weights read): ValueError naming the adapter and
    the problem (missing or corrupt files, a rank above max_lora_rank, a module the
    model lacks, shapes of another base model)."""
    name, folder = request.lora_name, Path(request.lora_path)
    config = _config(folder, name)
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(
            f"LoRA adapter {name!r}: rank {rank} exceeds max_lora_rank {max_lora_rank}"
        )
    scale = _scale(config, rank, name)
    tensors = _Tensors(folder, name)
    sides: dict[tuple[int, str], dict[str, str]] = {}
    for key, shape in tensors.shapes.items():
        if _FROZEN_TABLE.fullmatch(key):
            _check_frozen_table(key, shape, model, name)
            continue
        layer, module, side = _parse_key(key, name)
        if layer >= model.num_layers:
            raise ValueError(
                f"LoRA adapter {name!r}: tensor {key} is for layer {layer}; the model has "
                f"{model.num_layers}"
            )
        sides.setdefault((layer, module), {})[side] = key
    pairs = {}
    for (layer, module), pair in sorted(sides.items()):
        where = module if layer == MODEL_LAYER else f"layers.{layer}.{module}"
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {where} lacks its lora_A or lora_B")
        out, inp = projection_shape(model, module)
        a, b = tensors.shapes[pair["A"]], tensors.shapes[pair["B"]]
        if a != (rank, inp) or b != (out, rank):
            raise ValueError(
                f"LoRA adapter {name!r}: {where} has lora_A {a} and lora_B {b}; this base "
                f"model takes [{rank}, {inp}] and [{out}, {rank}] (an adapter of another "
                "base model?)"
            )
        pairs[(layer, module)] = (pair["A"], pair["B"])
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: it holds no LoRA weights")
    return _Layout(rank, scale, pairs, tensors)


def load_adapter(request: LoRARequest, model: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """`request`'s adapter, checked as check_adapter checks it, its weights read."""
    layout = check_adapter(request, model, max_lora_rank)
    read = layout.tensors.read([key for pair in layout.pairs.values() for key in pair])
    weights = {
        where: LoRAWeights(read[a].float().contiguous(), read[b].float().contiguous())
        for where, (a, b) in layout.pairs.items()
    }
    return LoRAAdapter(request, layout.rank, layout.scale, weights)


def _parse_key(key: str, name: str) -> tuple[int, str, str]:
    """(layer, module, "A" or "B") of a LoRA tensor's name; layer MODEL_LAYER for the
    embedding's and the LM head's."""
    vocab = _VOCAB_KEY.fullmatch(key)
    if vocab is not None:
        module, side = (vocab[1], vocab[2]) if vocab[1] else (vocab[3], vocab[4])
        return MODEL_LAYER, module, side
    match = _KEY.fullmatch(key)
    if match is None:
        raise ValueError(
            f"LoRA adapter {name!r}: tensor {key} is not a LoRA pair of a decoder layer's "
            f"projection ({', '.join(TARGET_MODULES)}), the embedding or the LM head"
        )
    if match[2] not in TARGET_MODULES:
        raise ValueError(
            f"LoRA adapter {name!r}: target module {match[2]} (tensor {key}) is not one "
            f"of the model's projections ({', '.join(TARGET_MODULES)})"
        )
    return int(match[1]), match[2], match[3]


def _check_frozen_table(key: str, shape: tuple[int, ...], model: ModelConfig, name: str) -> None:
    """PEFT's copy of the frozen embedding or head: the base model's shape (a resized
    vocabulary, new tokens trained in, is another model's)."""
    want = (model.vocab_size, model.hidden_size)
    if shape != want:
        raise ValueError(
            f"LoRA adapter {name!r}: tensor {key} is {list(shape)}; this base model's "
            f"is {list(want)} (an adapter with a resized vocabulary is not supported)"
        )
