"""What a model class reads its config from.

The loader reads the values that every checkpoint gives alike (`CommonValues`: rope,
special tokens) and hands them, with the checkpoint's own config (a config.json's object,
or a GGUF file's metadata as `GGUFMetadata`), to the model class that runs the
architecture. The class reads the rest (its sizes under its own names, its family's
switches) and returns the `ModelConfig`. A class that loads GGUF files declares each
llama.cpp architecture it takes as a `GGUFArchitecture`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from pyengine.config import ModelConfig


@dataclass(frozen=True)
class CommonValues:
    """What the loader reads the same way from every checkpoint, for the model class to
    put into its ModelConfig. A class without a rotary embedding leaves the rope values
    out."""

    architecture: str  # the Hugging Face architecture name
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class GGUFMetadata:
    """A GGUF file's metadata as a model class reads it: the key-value fields, the names
    of the file's tensors (whose presence says what the model has, such as q/k biases),
    and the architecture that prefixes the model's keys."""

    fields: Mapping[str, Any]
    tensor_names: Collection[str]
    architecture: str  # general.architecture, as "llama"

    def field(self, key: str, default: Any = None) -> Any:
        """The value of `<architecture>.<key>`, or `default`; a ValueError naming the key
        when it is missing and there is no default."""
        value = self.fields.get(f"{self.architecture}.{key}", default)
        if value is None:
            raise ValueError(f"metadata {self.architecture}.{key} is missing")
        return value


@dataclass(frozen=True)
class GGUFArchitecture:
    """One llama.cpp architecture that a model class loads from a GGUF file: how its
    config is read and how its tensors are named."""

    name: str  # general.architecture in the file, and the prefix of its metadata keys
    hf_architecture: str  # the Hugging Face architecture it runs as
    read_config: Callable[[GGUFMetadata, CommonValues], ModelConfig]
    # llama.cpp's tensor names and the model's Hugging Face ones: whole names outside the
    # layers; inside them blk.N.<part>.weight becomes <layer_prefix>.N.<layer name>.weight,
    # and a key "<part>.<weight|bias>" names a whole leaf (blk.N.exp_probs_b.bias:
    # <layer_prefix>.N.mlp.gate.e_score_correction_bias), as does the key of a tensor
    # named without either (blk.N.ssm_a: "ssm_a" -> "mixer.A_log").
    global_tensors: Mapping[str, str]
    layer_tensors: Mapping[str, str]
    layer_prefix: str
    # llama.cpp's Llama conversion interleaves the rotary halves of each head's q and k
    # rows; the loader puts them back as Hugging Face's rotate_half expects.
    rope_permuted: bool = False
    # Where one llama.cpp name holds more than one architecture (its llama with experts is
    # Mixtral): whether a file's metadata is this one's. None: the name's default.
    holds: Callable[[GGUFMetadata], bool] | None = None
    # A float tensor's values as the Hugging Face checkpoint holds them, by its Hugging
    # Face name and the model's config, where llama.cpp's conversion changed them
    # (Gemma's norms: it stores 1 + w; Mamba-2's A: -exp(A_log)). None: as they are.
    # (Block-quantized matrices are read as stored: only float tensors may change.)
    to_hf: Callable[[str, Any, ModelConfig], Any] | None = None
    # The Hugging Face order of a tensor's rows (indices into the file's), by its Hugging
    # Face name and the config, where llama.cpp's conversion reordered them (Qwen3.5's
    # value heads), for floats and blocks alike. None (or a None order): as stored.
    row_order: Callable[[str, ModelConfig], Any] | None = None
    # Whether a tensor's blocks may stay blocks: not where its columns were reordered,
    # which only to_hf undoes, on floats (dequantized at load). None: every one may.
    keeps_blocks: Callable[[str], bool] | None = None


def hf_values_from_gguf(m: GGUFMetadata) -> dict[str, Any]:
    """The config.json keys every llama.cpp architecture's metadata gives alike, by
    Hugging Face's names, for a model class that reads a GGUF file as the config.json it
    was converted from (its own keys beside these)."""
    heads = integer(m.field("attention.head_count"))
    vocab = m.fields.get(f"{m.architecture}.vocab_size", len(m.fields["tokenizer.ggml.tokens"]))
    return {
        "vocab_size": integer(vocab),
        "hidden_size": integer(m.field("embedding_length")),
        "num_hidden_layers": integer(m.field("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": integer(m.field("attention.head_count_kv", heads)),
        "max_position_embeddings": integer(m.field("context_length")),
        "rms_norm_eps": float(m.field("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in m.tensor_names,
    }


def integer(value: Any) -> int:
    """A config count: an integer (or a float that is one), nothing else."""
    if isinstance(value, bool) or not (
        isinstance(value, int) or isinstance(value, float) and value.is_integer()
    ):
        raise ValueError(f"{value!r} where an integer belongs")
    return int(value)


def head_size_of(hidden: int, heads: int) -> int:
    """The size of each attention head when `heads` share the hidden size evenly."""
    if heads < 1 or hidden % heads:
        raise ValueError(f"hidden size {hidden} does not split into {heads} attention heads")
    return hidden // heads
