"""Two peft adapters of the default model (SmolLM2-135M-Instruct, its GGUF weights held as
blocks, the head tied to the embedding), random A and B over every projection (the
second also over the embedding and the LM head): greedy float32 tokens equal
transformers + peft's on the same weights, both adapters and the base model in one
batch."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hf_reference import hf_greedy, hf_model_from_weights
from helpers.lora import ALL_MODULES, make_adapter
from helpers.smollm2 import make_prompts

from pyengine import LLM, LoRARequest, SamplingParams
from pyengine.loader.resolve import default_model_path, load_model

pytest.importorskip("peft")
pytestmark = pytest.mark.slow  # the default model loaded three times

NEW_TOKENS = 8


def test_default_model_adapters_give_peft_greedy_tokens(tmp_path: Path) -> None:
    try:
        default_model_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    loaded = load_model("SmolLM2-135M-Instruct")
    prompts = make_prompts(loaded.tokenizer)[:2]
    expected, requests = {}, {}
    modules = {"first": ALL_MODULES, "second": [*ALL_MODULES, "embed_tokens", "lm_head"]}
    for seed, name in enumerate(("first", "second"), start=1):
        base = hf_model_from_weights(loaded.config, loaded.weights)
        model = make_adapter(base, tmp_path / name, seed, 8, modules[name]).eval()
        expected[name] = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
        requests[name] = LoRARequest(name, seed, str(tmp_path / name))
    base = hf_model_from_weights(loaded.config, loaded.weights)
    expected["base"] = [hf_greedy(base, p, NEW_TOKENS) for p in prompts]
    llm = LLM(max_model_len=512, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32")
    names = ["first", "base", "second"]
    batch = [{"prompt_token_ids": p} for p in prompts for _ in names]
    loras = [requests.get(n) for _ in prompts for n in names]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(batch, params, use_tqdm=False, lora_request=loras)
    want = [expected[n][i] for i in range(len(prompts)) for n in names]
    assert [list(o.outputs[0].token_ids) for o in outputs] == want
    assert len({tuple(w) for w in want}) > 2  # the adapters change the tokens
    llm.llm_engine.shutdown()
