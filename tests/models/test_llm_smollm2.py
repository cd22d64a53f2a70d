"""The default model end to end: pyengine's greedy tokens equal transformers' on the same
weights, under prefix caching, chunked prefill and preemption."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_reference import hf_greedy, hf_model_from_weights
from helpers.smollm2 import NEW_TOKENS, make_prompts

from pyengine import LLM, SamplingParams
from pyengine.loader.resolve import default_model_path, load_model

pytest.importorskip("transformers")

# The default model loaded twice (pyengine, transformers): the slowest module on a CPU.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loaded():  # type: ignore[no-untyped-def]
    try:
        default_model_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return load_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def prompts(loaded):  # type: ignore[no-untyped-def]
    return make_prompts(loaded.tokenizer)


@pytest.fixture(scope="module")
def expected(loaded, prompts):  # type: ignore[no-untyped-def]
    model = hf_model_from_weights(loaded.config, loaded.weights)
    return [hf_greedy(model, p, NEW_TOKENS) for p in prompts]


def test_loaded_weights_equal_transformers_gguf_loading(loaded) -> None:  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    reference = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    tensors = reference["tensors"]
    assert set(tensors) == set(loaded.weights)
    for name, tensor in loaded.weights.items():
        assert torch.equal(tensor, tensors[name]), name


@pytest.mark.parametrize(
    ("prefix_caching", "chunked", "kv_blocks"),
    [(True, True, None), (False, True, None), (True, False, None), (True, True, 80)],
    ids=["prefix+chunked", "no-prefix-cache", "no-chunked", "preemption"],
)
def test_greedy_matches_transformers(
    prompts, expected, prefix_caching: bool, chunked: bool, kv_blocks: int | None
) -> None:  # type: ignore[no-untyped-def]
    block_bytes = 2 * 30 * 3 * 64 * 16 * 4
    llm = LLM(
        dtype="float32",
        max_model_len=1024,
        enable_prefix_caching=prefix_caching,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=128 if chunked else 1024,
        kv_cache_memory=None if kv_blocks is None else kv_blocks * block_bytes,
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (out, want) in enumerate(zip(outputs, expected, strict=True)):
        assert out.outputs[0].token_ids == want, f"prompt {i} ({len(prompts[i])} tokens)"
        assert out.outputs[0].finish_reason == "length"
    stats = llm.llm_engine.stats()
    if kv_blocks is not None:
        assert stats.num_preemptions > 0, "the small KV pool was meant to force preemption"
    assert llm.llm_engine.scheduler.kv_cache.stats().num_used_blocks == 0, "blocks leaked"


def test_shared_prefix_hits_the_cache_and_keeps_the_tokens(loaded, prompts, expected) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(max_model_len=1024, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    long_prompt = prompts[-1]
    first = llm.generate({"prompt_token_ids": long_prompt}, params, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": long_prompt}] * 4, params, use_tqdm=False)
    assert first[0].outputs[0].token_ids == expected[-1]
    assert all(o.outputs[0].token_ids == expected[-1] for o in again)
    assert llm.llm_engine.stats().prefix_cache_hit_rate > 0.5
    assert first[0].num_cached_tokens == 0
    # Whole blocks of the prompt came from the cache; at least its last token is computed.
    for out in again:
        assert len(long_prompt) - 16 <= out.num_cached_tokens < len(long_prompt)
        assert out.num_cached_tokens % 16 == 0


def test_chat_answers_from_the_model(loaded) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(max_model_len=512, dtype="float32")
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=20),
        use_tqdm=False,
    )
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"  # EOS (<|im_end|>)
    question = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="chat template failed: ZeroDivisionError"):
        llm.chat(question, chat_template="{{ 1/0 }}", use_tqdm=False)
    # OpenAI's content forms: text parts, as the same text; None, as empty.
    params = SamplingParams(temperature=0, max_tokens=3)
    parts = [{"type": "text", "text": t} for t in ("What is the capital", "of France?")]
    as_parts = llm.chat([{"role": "user", "content": parts}], params, use_tqdm=False)[0]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]
    assert as_parts.prompt == llm.chat(joined, params, use_tqdm=False)[0].prompt
    assert llm.chat([{"role": "user", "content": None}], params, use_tqdm=False)[0].outputs
    with pytest.raises(ValueError, match="only text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], use_tqdm=False)
