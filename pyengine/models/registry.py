"""From the architecture name a Hugging Face config.json gives to the model class."""

from __future__ import annotations

from pyengine.models.gpt import LearnedPositionDecoder
from pyengine.models.interface import CausalLM
from pyengine.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "OPTForCausalLM": LearnedPositionDecoder,
    "GPT2LMHeadModel": LearnedPositionDecoder,
}

ARCHITECTURES = tuple(_MODELS)


def model_class(architecture: str) -> type[CausalLM]:
    """The class that runs `architecture`; ValueError naming the ones pyengine runs."""
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture} is not supported; pyengine runs "
            f"{', '.join(ARCHITECTURES)}"
        )
    return _MODELS[architecture]
