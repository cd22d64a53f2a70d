"""The model classes, found by the architecture names they declare.

Each model class names the Hugging Face architectures it runs (`hf_architectures`, as a
config.json's `architectures` gives them) and the llama.cpp ones it loads from GGUF files
(`gguf_architectures`), and reads its own config (see models/checkpoint_config.py).
Adding an architecture is its module and its registration here: the class imported and
put in MODEL_CLASSES.
"""

from __future__ import annotations

from pyengine.models.bert import BertEncoder, RobertaEncoder
from pyengine.models.checkpoint_config import GGUFArchitecture, GGUFMetadata
from pyengine.models.deepseek import DeepseekForCausalLM
from pyengine.models.falcon_h1 import FalconH1ForCausalLM
from pyengine.models.gemma import GemmaForCausalLM
from pyengine.models.gpt import GPT2ForCausalLM, OPTForCausalLM
from pyengine.models.gpt_oss import GptOssForCausalLM
from pyengine.models.granite_hybrid import GraniteMoeHybridForCausalLM
from pyengine.models.interface import CausalLM
from pyengine.models.llama import LlamaForCausalLM
from pyengine.models.llama4 import Llama4ForCausalLM
from pyengine.models.llama_moe import LlamaMoeForCausalLM
from pyengine.models.mamba2 import Mamba2ForCausalLM
from pyengine.models.qwen3_next import Qwen3NextForCausalLM
from pyengine.models.sequence_classification import LlamaForSequenceClassification

MODEL_CLASSES: tuple[type[CausalLM], ...] = (
    LlamaForCausalLM,
    LlamaMoeForCausalLM,
    GemmaForCausalLM,
    GptOssForCausalLM,
    Llama4ForCausalLM,
    DeepseekForCausalLM,
    Qwen3NextForCausalLM,
    Mamba2ForCausalLM,
    GraniteMoeHybridForCausalLM,
    FalconH1ForCausalLM,
    OPTForCausalLM,
    GPT2ForCausalLM,
    BertEncoder,
    RobertaEncoder,
    LlamaForSequenceClassification,
)


def _by_name() -> dict[str, type[CausalLM]]:
    found: dict[str, type[CausalLM]] = {}
    for cls in MODEL_CLASSES:
        for name in cls.hf_architectures:
            if name in found:
                raise ValueError(f"{found[name].__name__} and {cls.__name__} both run {name}")
            found[name] = cls
    return found


def _by_gguf_name() -> dict[str, tuple[GGUFArchitecture, ...]]:
    """Each llama.cpp name's architectures: those that hold files by their metadata first,
    then the name's default (one at most)."""
    found: dict[str, list[GGUFArchitecture]] = {}
    for cls in MODEL_CLASSES:
        for arch in cls.gguf_architectures:
            if arch.hf_architecture not in cls.hf_architectures:
                raise ValueError(
                    f"{cls.__name__} loads GGUF {arch.name} as {arch.hf_architecture}, "
                    "which it does not run"
                )
            found.setdefault(arch.name, []).append(arch)
    for name, archs in found.items():
        if sum(arch.holds is None for arch in archs) > 1:
            raise ValueError(f"two model classes load GGUF architecture {name}")
        archs.sort(key=lambda arch: arch.holds is None)
    return {name: tuple(archs) for name, archs in found.items()}


_MODELS = _by_name()
_GGUF = _by_gguf_name()

ARCHITECTURES = tuple(_MODELS)
GGUF_ARCHITECTURES = tuple(_GGUF)


def model_class(architecture: str) -> type[CausalLM]:
    """The class that runs `architecture`; ValueError naming the ones pyengine runs (any
    value: a config.json may name a list or an object, which no dict lookup takes)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"architecture {architecture} is not supported; pyengine runs "
            f"{', '.join(ARCHITECTURES)}"
        )
    return _MODELS[architecture]


def gguf_architecture(name: str, metadata: GGUFMetadata | None = None) -> GGUFArchitecture:
    """The llama.cpp architecture `name` (a GGUF file's general.architecture) as a model
    class loads it, chosen by the file's metadata where the name holds several; ValueError
    naming the ones pyengine loads."""
    if name not in _GGUF:
        raise ValueError(
            f"GGUF architecture {name!r} is not supported ({', '.join(GGUF_ARCHITECTURES)})"
        )
    for arch in _GGUF[name]:
        if arch.holds is None or (metadata is not None and arch.holds(metadata)):
            return arch
    raise ValueError(f"GGUF architecture {name!r}: this file is none of the forms pyengine loads")
