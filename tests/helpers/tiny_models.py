"""Tiny models for the engine and model tests: a dummy-weights Llama config, and random
float32 checkpoints of every supported architecture saved by transformers."""

from __future__ import annotations

from pathlib import Path

import torch

try:
    import transformers
except ImportError:  # the tests that make checkpoints skip on their own importorskip
    transformers = None

# A small Llama to build with load_format="dummy" (random weights): write it as a folder's
# config.json.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


COMMON = {"vocab_size": 256, "max_position_embeddings": 256}


LLAMA_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}


CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, **LLAMA_SHAPE, tie_word_embeddings=False),
    "llama3-rope": lambda: transformers.LlamaConfig(
        **COMMON,
        **LLAMA_SHAPE,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, **LLAMA_SHAPE, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, **LLAMA_SHAPE),
    # (q/k/v in one qkv_proj tensor, gate/up in one gate_up_proj; a window the prompts pass)
    "phi3": lambda: transformers.Phi3Config(
        **COMMON,
        **LLAMA_SHAPE,
        sliding_window=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "mistral": lambda: transformers.MistralConfig(**COMMON, **LLAMA_SHAPE, sliding_window=16),
    "opt": lambda: transformers.OPTConfig(
        **COMMON,
        hidden_size=128,
        ffn_dim=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=128,
    ),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=256, n_positions=256, n_embd=128, n_layer=2, n_head=4
    ),
}


def make_checkpoint(kind: str, folder: Path) -> torch.nn.Module:
    """A random float32 checkpoint of CONFIGS[kind], saved to folder; the model."""
    torch.manual_seed(0)
    config = CONFIGS[kind]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # larger than the default init, so that the logits say something
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(folder)
    return model


PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(20, 60))]


def greedy_tokens(llm: object, max_tokens: int = 12) -> list[list[int]]:
    """The greedy tokens of `llm` (an LLM) for PROMPTS."""
    from pyengine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[attr-defined]
    return [list(o.outputs[0].token_ids) for o in outputs]
