"""Hugging Face folders (config.json and SmolLM2's tokenizer, no weights: the engines
load dummy weights) of Gemma-3-1B's and DeepSeek-V2-Lite's shapes, with SmolLM2's
vocabulary (49152), for bench/attention_variants.py. DeepSeek-V2-Lite keeps its first
--deepseek-layers layers (one dense, the rest experts), so that two engines fit in memory
beside each other."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from .shape_checkpoints import VOCAB

GEMMA3_1B: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "vocab_size": VOCAB, "hidden_size": 1152, "intermediate_size": 6912,
    "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "sliding_window": 512, "query_pre_attn_scalar": 256,
    "layer_types": ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(26)],
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768, "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}  # fmt: skip


def deepseek_v2_lite(layers: int) -> dict[str, Any]:
    return {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": VOCAB, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": layers, "num_attention_heads": 16,
        "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy",
        "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 32768, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }  # fmt: skip


def variant_folder(name: str, config: dict[str, Any], tokenizer_folder: Path, cache: Path) -> Path:
    folder = cache / f"{name}-shape"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(tokenizer_folder / "tokenizer.json", folder / "tokenizer.json")
    return folder
