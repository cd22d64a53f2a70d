"""`pyengine serve` on tiny random checkpoints of the attention variants' architectures
(Gemma 3's sliding windows, gpt-oss's windows and sinks, Llama 4's chunks, DeepSeek-V3's
latent cache) and of hybrid models with recurrent state (Qwen3-Next, Granite 4), each
with a byte-level tokenizer: a chat completion constrained by a JSON
schema parses and fits it, and a greedy completion is the offline engine's text."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.byte_tokenizer import EOS, VOCAB, write_byte_tokenizer
from helpers.server import Server, openai_client
from helpers.tiny_deepseek import deepseek_config

from pyengine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("openai")

COMMON = dict(vocab_size=VOCAB, eos_token_id=EOS, bos_token_id=None, pad_token_id=None,
              tie_word_embeddings=False, max_position_embeddings=256)  # fmt: skip
ATTENTION = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
CONFIGS: dict[str, Callable[[], Any]] = {
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **COMMON, **ATTENTION, intermediate_size=96, num_hidden_layers=3, sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),
    "gpt_oss": lambda: transformers.GptOssConfig(
        **COMMON, **ATTENTION, intermediate_size=48, num_hidden_layers=2, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=16,
    ),
    "llama4": lambda: transformers.Llama4TextConfig(
        **COMMON, **ATTENTION, intermediate_size=48, intermediate_size_mlp=96,
        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, attention_chunk_size=16,
    ),
    "deepseek_v3": lambda: deepseek_config("v3", **COMMON, num_hidden_layers=2),
    # Recurrent state: Gated DeltaNet beside gated attention, Mamba-2 beside attention.
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **COMMON, **ATTENTION, intermediate_size=96, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    "granite_hybrid": lambda: transformers.GraniteMoeHybridConfig(
        **COMMON, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=8, num_local_experts=4,
        num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=48,
        position_embedding_type="rope",
    ),
}  # fmt: skip
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}  # fmt: skip
ENGINE = dict(max_model_len=256, kv_cache_memory=32 * 2**20)
PROMPT = "The paged cache holds blocks of sixteen tokens, and windows release theirs."


def checkpoint(arch: str, folder: Path) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch](), dtype=torch.float32)
    with torch.no_grad():  # (random norms too)
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.08)
    model.eval().save_pretrained(folder)
    write_byte_tokenizer(folder)
    return folder


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_served_with_constrained_output(arch: str, tmp_path: Path) -> None:
    folder = checkpoint(arch, tmp_path / arch)
    server = Server(str(folder), max_model_len=256, kv_cache_bytes=32 * 2**20)
    try:
        client = openai_client(server)
        done = client.chat.completions.create(
            model=str(folder), messages=[{"role": "user", "content": "Is it ok?"}],
            max_tokens=100, temperature=0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "answer", "schema": SCHEMA}},
        )  # fmt: skip
        answer = done.choices[0].message.content
        assert done.choices[0].finish_reason == "stop", answer
        assert isinstance(json.loads(answer or "")["ok"], bool)
        served = client.completions.create(
            model=str(folder), prompt=PROMPT, max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    finally:
        assert server.stop() == 0
    llm = LLM(str(folder), **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    offline = llm.generate([PROMPT], params, use_tqdm=False)
    llm.llm_engine.shutdown()
    assert served.choices[0].text == offline[0].outputs[0].text
