"""The default model end to end on a CUDA GPU: greedy float32 tokens equal transformers'
on the same GPU and weights, and the KV cache takes what gpu_memory_utilization leaves.
Skipped, with the reason shown, where there is no GPU or pyengine was built without CUDA."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers.hf_reference import hf_greedy, hf_model_from_weights
from helpers.smollm2 import NEW_TOKENS, make_prompts

from pyengine import LLM, SamplingParams, built_with_cuda
from pyengine.loader.resolve import default_model_path, load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and built_with_cuda()),
        reason="needs a CUDA GPU and pyengine built with CUDA",
    ),
]


@pytest.fixture(scope="module")
def loaded():  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    try:
        default_model_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return load_model("SmolLM2-135M-Instruct")


def test_greedy_float32_tokens_match_transformers_on_the_gpu(loaded) -> None:  # type: ignore[no-untyped-def]
    prompts = make_prompts(loaded.tokenizer)
    hf = hf_model_from_weights(loaded.config, loaded.weights).to("cuda")
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    del hf
    llm = LLM(
        "SmolLM2-135M-Instruct",
        device="cuda",
        dtype="float32",
        max_model_len=1024,
        max_num_batched_tokens=512,
        gpu_memory_utilization=0.3,
    )
    assert llm.llm_engine.executor.driver_worker.model_runner.caches[0][0].device.type == "cuda"
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    del llm  # its KV cache would count against the next test's budget
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_bfloat16_is_the_gpu_default_and_the_kv_cache_fits_the_budget(loaded) -> None:  # type: ignore[no-untyped-def]
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    llm = LLM("SmolLM2-135M-Instruct", max_model_len=2048, gpu_memory_utilization=0.25)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    key, value = runner.caches[0]
    assert key.dtype == torch.bfloat16 and key.device.type == "cuda"
    kv_bytes = (key.numel() + value.numel()) * key.element_size() * len(runner.caches)
    assert torch.cuda.memory_allocated() <= 0.25 * total
    # A 135M model and one step's activations leave most of the budget to the cache.
    assert kv_bytes >= 0.15 * total
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    text = llm.generate(["The capital of France is"], params, use_tqdm=False)
    assert len(text[0].outputs[0].token_ids) == 8 and text[0].outputs[0].text


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "opt", "gpt2"])
def test_tiny_checkpoints_match_transformers_on_the_gpu(name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Needs no model files: test_llm_tiny_models' random checkpoints, made here."""
    pytest.importorskip("transformers")
    from helpers.tiny_models import make_checkpoint

    model = make_checkpoint(name, tmp_path)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (1, 5, 17, 40, 90, 130)]
    expected = [hf_greedy(model.to("cuda"), p, 12) for p in prompts]
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_model_len=256,
              gpu_memory_utilization=0.1, max_num_batched_tokens=64)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_sampling_runs_on_the_gpu_and_seeds_hold_in_a_batch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Temperature, top-p and penalties sampled on the device: a seeded request gives the
    same tokens alone and among unseeded ones, and the sampler's generators are CUDA's."""
    pytest.importorskip("transformers")
    from helpers.tiny_models import make_checkpoint

    make_checkpoint("llama", tmp_path)
    llm = LLM(str(tmp_path), device="cuda", max_model_len=256, gpu_memory_utilization=0.1)
    assert llm.llm_engine.executor.driver_worker.sampler.generator.device.type == "cuda"
    prompt = torch.randint(0, 256, (20,)).tolist()
    seeded = SamplingParams(temperature=0.9, top_p=0.8, repetition_penalty=1.2, seed=7,
                            max_tokens=16, ignore_eos=True)  # fmt: skip
    other = SamplingParams(temperature=1.0, top_k=20, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate([prompt] * 4, [other, seeded, other, other], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    assert all(len(o.outputs[0].token_ids) == 16 for o in batch)
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize(("kv", "storage"), [("fp8", torch.uint8), ("int8", torch.int8)])
def test_an_8bit_cache_under_bfloat16_weights_on_the_gpu(loaded, kv: str, storage) -> None:  # type: ignore[no-untyped-def]
    prompts = make_prompts(loaded.tokenizer)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    runs = {}
    for cache in ("auto", kv):
        llm = LLM("SmolLM2-135M-Instruct", kv_cache_dtype=cache, max_model_len=1024,
                  gpu_memory_utilization=0.2)  # fmt: skip
        assert llm.llm_engine.executor.driver_worker.model_runner.cache_dtype == (
            storage if cache == kv else torch.bfloat16
        )
        runs[cache] = llm.generate(prompts, params, use_tqdm=False)
        llm.llm_engine.shutdown()
        gc.collect()
        torch.cuda.empty_cache()
    # The first token's logprobs: the 8-bit cache's against the bfloat16 one's.
    for narrow, full in zip(runs[kv], runs["auto"], strict=True):
        first = narrow.outputs[0].logprobs[0]
        for token, entry in full.outputs[0].logprobs[0].items():
            assert token in first and abs(first[token].logprob - entry.logprob) < 0.15
