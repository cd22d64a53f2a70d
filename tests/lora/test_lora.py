"""Multi-LoRA against transformers + peft on the same weights: adapters made here with peft
on tiny llama-family checkpoints (random A and B, so that every delta matters), each
adapter's greedy float32 tokens equal peft's; a batch mixing adapters and the base model
gives every request its tokens alone; more adapters in flight than max_loras all finish,
swapped through the slots; two adapters never share prefix-cache blocks; bad adapters are
clear errors and the engine keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from helpers.lora import NEW_TOKENS, PROMPTS, make_adapter
from safetensors.torch import load_file, save

from pyengine import LLM, LoRARequest, SamplingParams, built_with_cuda

pytest.importorskip("peft")

GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE = dict(max_model_len=128, kv_cache_memory=2**22, enable_lora=True, dtype="float32")


def tokens(outputs: list) -> list[list[int]]:  # type: ignore[type-arg]
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_each_adapter_gives_peft_greedy_tokens(family: dict) -> None:  # type: ignore[type-arg]
    llm = LLM(str(family["root"] / "base"), max_loras=2, **ENGINE)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for name, request in family["requests"].items():
        got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=request))
        assert got == family["expected"][name], name
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == family["expected"]["base"]
    assert llm.llm_engine.scheduler.kv_cache.num_free_blocks == llm.llm_engine.executor.num_blocks
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["recorded", "eager"])
def test_a_batch_mixing_four_adapters_and_the_base_model(family: dict, enforce_eager: bool) -> None:  # type: ignore[type-arg]
    """Decode steps replayed from their recorded kernel calls (each row's slot read in
    place) and run eagerly give the same tokens."""
    llm = LLM(str(family["root"] / "base"), max_loras=4, enforce_eager=enforce_eager, **ENGINE)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert (runner.graphs is None) == enforce_eager
    names = ["a", "b", "base", "c", "d"]
    prompts, loras, want = [], [], []
    for i, name in enumerate(names * 2):
        p = PROMPTS[i % len(PROMPTS)]
        prompts.append({"prompt_token_ids": p})
        loras.append(family["requests"].get(name))
        want.append(family["expected"][name][i % len(PROMPTS)])
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)) == want
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("path", ["recorded", "eager", "torch"])
def test_embedding_and_head_adapters_mix_with_the_others(
    family: dict,
    path: str,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[type-arg]
) -> None:
    """Adapters of the embedding and the LM head (e, f) beside one of the layers only (a)
    and the base model: each row's embedding and logits through its own adapter, in
    recorded steps, eager ones, and through torch's products (a GPU's path)."""
    if path == "torch":
        monkeypatch.setattr("pyengine.lora.layers._cpu_kernel", lambda dtype, device: False)
    eager = path != "recorded"
    llm = LLM(str(family["root"] / "base"), max_loras=3, enforce_eager=eager, **ENGINE)
    lora = llm.llm_engine.executor.driver_worker.model_runner.lora
    assert lora is not None and lora.replays_in_place == (path != "torch")
    names = ["e", "a", "base", "f"]
    prompts, loras, want = [], [], []
    for i, name in enumerate(names * 2):
        prompts.append({"prompt_token_ids": PROMPTS[i % len(PROMPTS)]})
        loras.append(family["requests"].get(name))
        want.append(family["expected"][name][i % len(PROMPTS)])
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)) == want
    llm.llm_engine.shutdown()


def test_prompt_logprobs_through_a_head_adapter(family: dict) -> None:  # type: ignore[type-arg]
    """Prompt logprobs are scored a few rows at a time (max_num_seqs), each slice
    through its rows' adapters: peft's log-softmax at every position."""
    llm = LLM(str(family["root"] / "base"), max_loras=2, max_num_seqs=4, **ENGINE)
    prompt = PROMPTS[2]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    loras = [family["requests"]["e"], family["requests"]["f"]]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * 2, params, use_tqdm=False,
                           lora_request=loras)  # fmt: skip
    for output, name in zip(outputs, ("e", "f"), strict=True):
        with torch.inference_mode():
            logits = family["peft"][name](torch.tensor([prompt])).logits[0]
        want = torch.log_softmax(logits.double(), dim=-1)
        scores = output.prompt_logprobs
        assert scores is not None and scores[0] is None
        for position in range(1, len(prompt)):
            entry = scores[position]
            assert entry is not None
            token = prompt[position]
            expected = float(want[position - 1, token])
            assert entry[token].logprob == pytest.approx(expected, abs=1e-4), (name, position)
    llm.llm_engine.shutdown()


def test_more_adapters_than_slots_all_finish_through_swaps(family: dict) -> None:  # type: ignore[type-arg]
    llm = LLM(str(family["root"] / "base"), max_loras=1, max_cpu_loras=2, **ENGINE)
    names = ["a", "b", "c", "d", "a", "base"]
    loras = [family["requests"].get(n) for n in names]
    prompts = [{"prompt_token_ids": PROMPTS[2]}] * len(names)
    want = [family["expected"][n][2] for n in names]
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)) == want
    lora = llm.llm_engine.executor.driver_worker.model_runner.lora
    assert lora is not None and lora.stats.swapped_in >= 4 and lora.stats.evicted >= 2
    assert len(lora.host) <= 2
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])  # fmt: skip
def test_adapters_shard_with_the_layers(family: dict, split: dict) -> None:  # type: ignore[type-arg]
    """Two ranks (a process each): column-parallel layers hold their rows of B (the LM
    head its vocabulary's), row-parallel ones their columns of A, a pipeline stage its
    layers' slots (the first the embedding's, the last the head's); the same tokens."""
    llm = LLM(str(family["root"] / "base"), max_loras=3, **ENGINE, **split)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS] * 2
    names = ("e", "c", "base", "a", "f", "e")
    loras = [family["requests"].get(n) for n in names]
    want = [family["expected"][n][i % len(PROMPTS)] for i, n in enumerate(names)]
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)) == want
    llm.llm_engine.shutdown()


def test_adapters_never_share_prefix_cache_blocks(family: dict) -> None:  # type: ignore[type-arg]
    llm = LLM(str(family["root"] / "base"), max_loras=2, **ENGINE)
    prompt = [{"prompt_token_ids": list(range(30, 94))}]  # four blocks of 16
    scheduler = llm.llm_engine.scheduler
    a, b = family["requests"]["a"], family["requests"]["b"]

    def hits(lora: LoRARequest | None) -> int:
        before = scheduler.kv_cache.stats().prefix_cache_hits
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)
        return scheduler.kv_cache.stats().prefix_cache_hits - before

    assert hits(a) == 0
    assert hits(b) == 0  # the same prompt through another adapter: no hit
    assert hits(None) == 0
    assert hits(a) > 0  # the same adapter: its blocks
    llm.llm_engine.shutdown()


def write_bad(
    folder: Path,
    source: Path,
    config: dict | None = None,
    tensors: bytes | None = None,  # type: ignore[type-arg]
) -> None:
    folder.mkdir()
    base_config = json.loads((source / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**base_config, **(config or {})}))
    data = (source / "adapter_model.safetensors").read_bytes() if tensors is None else tensors
    (folder / "adapter_model.safetensors").write_bytes(data)


def test_bad_adapters_are_clear_errors_and_the_engine_keeps_serving(
    family: dict,
    tmp_path: Path,  # type: ignore[type-arg]
) -> None:
    root, good = family["root"], family["requests"]["a"]
    llm = LLM(str(root / "base"), max_loras=1, max_lora_rank=8, **ENGINE)
    prompt = [{"prompt_token_ids": PROMPTS[0]}]
    write_bad(tmp_path / "corrupt", root / "a", tensors=b"not a safetensors file")
    write_bad(tmp_path / "dora", root / "a", {"use_dora": True})
    other = tmp_path / "other-base"
    smaller = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16)  # fmt: skip
    make_adapter(transformers.LlamaForCausalLM(smaller), other, 5)
    tables = load_file(str(root / "e" / "adapter_model.safetensors"))
    frozen = "base_model.model.model.embed_tokens.base_layer.weight"
    tables[frozen] = torch.cat([tables[frozen], torch.zeros(8, tables[frozen].shape[1])])
    write_bad(tmp_path / "resized", root / "e", tensors=save(tables))
    write_bad(tmp_path / "pattern", root / "a", {"rank_pattern": {"q_proj": 4}})
    cases = {
        "rank 16 exceeds max_lora_rank 8": LoRARequest("c", 3, str(root / "c")),
        "does not exist": LoRARequest("missing", 9, str(tmp_path / "missing")),
        "is corrupt": LoRARequest("corrupt", 10, str(tmp_path / "corrupt")),
        "DoRA is not supported": LoRARequest("dora", 11, str(tmp_path / "dora")),
        "another base model": LoRARequest("other", 12, str(other)),
        "resized vocabulary is not supported": LoRARequest(
            "resized", 13, str(tmp_path / "resized")
        ),
        "per-module rank_pattern is not supported": LoRARequest(
            "pattern", 14, str(tmp_path / "pattern")
        ),
        "lora_int_id 1 is adapter 'a'": LoRARequest("a-again", 1, str(root / "b")),
    }
    llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=good)  # id 1 known
    for message, request in cases.items():
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=request)
    assert tokens(llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=good)) == [
        family["expected"]["a"][0]
    ]
    assert llm.llm_engine.scheduler.kv_cache.num_free_blocks == llm.llm_engine.executor.num_blocks
    llm.llm_engine.shutdown()
    plain = LLM(str(root / "base"), max_model_len=128, kv_cache_memory=2**22, dtype="float32")
    with pytest.raises(ValueError, match="start it with enable_lora=True"):
        plain.generate(prompt, GREEDY, use_tqdm=False, lora_request=good)
    plain.llm_engine.shutdown()
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, "/tmp")
    with pytest.raises(ValueError, match="max_loras must be a positive integer"):
        LLM(str(root / "base"), max_loras=0, **ENGINE)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and built_with_cuda()),
    reason="needs a CUDA GPU and pyengine built with CUDA",
)
def test_adapters_on_the_gpu_with_and_without_its_kernel(
    family: dict,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[type-arg]
) -> None:
    """float32 on the GPU: peft's tokens, through torch's products and through the CUDA
    kernel (PYENGINE_CUDA_LORA_KERNEL=1)."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    loras = [family["requests"][n] for n in ("a", "b", "c")]
    for flag in ("0", "1"):
        monkeypatch.setenv("PYENGINE_CUDA_LORA_KERNEL", flag)
        llm = LLM(str(family["root"] / "base"), device="cuda", dtype="float32", max_loras=3,
                  max_model_len=128, enable_lora=True)  # fmt: skip
        got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
        assert got == [family["expected"][n][i] for i, n in enumerate(("a", "b", "c"))], flag
        llm.llm_engine.shutdown()
