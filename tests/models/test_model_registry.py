"""The model registry and the configs each model class reads: every architecture name is
run by the class that declares it, and each family's switches come from its own
config.json keys (no model is built here)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from pyengine.config import FamilyConfig, ModelConfig
from pyengine.loader.hf_config import model_config_from_hf
from pyengine.models.checkpoint_config import GGUFMetadata
from pyengine.models.gpt import LearnedPositionConfig
from pyengine.models.llama import LlamaFamilyConfig
from pyengine.models.registry import (
    ARCHITECTURES,
    GGUF_ARCHITECTURES,
    MODEL_CLASSES,
    gguf_architecture,
    model_class,
)

LLAMA_LIKE: dict[str, Any] = {
    "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "sliding_window": 16,
}  # fmt: skip
OPT: dict[str, Any] = {
    "architectures": ["OPTForCausalLM"], "vocab_size": 64, "hidden_size": 64, "ffn_dim": 128,
    "num_hidden_layers": 2, "num_attention_heads": 2,
}  # fmt: skip
GPT2: dict[str, Any] = {
    "architectures": ["GPT2LMHeadModel"], "vocab_size": 64, "n_embd": 64, "n_layer": 2,
    "n_head": 2,
}  # fmt: skip


def llama_like(architecture: str, **entries: Any) -> ModelConfig:
    return model_config_from_hf({**LLAMA_LIKE, "architectures": [architecture], **entries})


def test_each_architecture_is_run_by_the_class_that_declares_it() -> None:
    declared = [name for cls in MODEL_CLASSES for name in cls.hf_architectures]
    assert sorted(declared) == sorted(ARCHITECTURES)
    for cls in MODEL_CLASSES:
        for name in cls.hf_architectures:
            assert model_class(name) is cls
        for arch in cls.gguf_architectures:
            if arch.holds is None:  # (the name's default)
                assert gguf_architecture(arch.name) is arch
            assert arch.hf_architecture in cls.hf_architectures
    # llama.cpp's llama with experts is Mixtral
    experts = GGUFMetadata({"llama.expert_count": 8}, (), "llama")
    assert gguf_architecture("llama", experts).hf_architecture == "MixtralForCausalLM"
    dense = GGUFMetadata({"llama.expert_count": 0}, (), "llama")
    assert gguf_architecture("llama", dense).hf_architecture == "LlamaForCausalLM"
    assert GGUF_ARCHITECTURES == (
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "phi3",
        "qwen2moe",
        "qwen3moe",
        "gemma2",
        "gemma3",
        "gpt-oss",
        "llama4",
        "deepseek2",
        "qwen3next",
        "qwen35",
        "qwen35moe",
        "mamba2",
        "granitehybrid",
        "falcon-h1",
    )
    # llama.cpp's deepseek2 is V3 where its experts route by sigmoid (expert_gating_func 2)
    v3 = GGUFMetadata({"deepseek2.expert_gating_func": 2}, (), "deepseek2")
    assert gguf_architecture("deepseek2", v3).hf_architecture == "DeepseekV3ForCausalLM"
    v2 = GGUFMetadata({}, (), "deepseek2")
    assert gguf_architecture("deepseek2", v2).hf_architecture == "DeepseekV2ForCausalLM"
    llama_gguf = model_class("LlamaForCausalLM").gguf_architectures
    assert [a.name for a in llama_gguf if a.rope_permuted] == ["llama", "mistral"]
    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' is not supported \(llama, "):
        gguf_architecture("gpt2")


def test_each_llama_family_member_reads_its_own_switches() -> None:
    llama = llama_like("LlamaForCausalLM")
    assert llama.family == LlamaFamilyConfig(attention_bias=False, qk_norm=False)
    assert llama.sliding_window == 0  # only Mistral's config.json sliding_window is read
    assert llama_like("MistralForCausalLM").sliding_window == 16
    assert llama_like("MistralForCausalLM", use_sliding_window=False).sliding_window == 0
    assert llama_like("Qwen2ForCausalLM").family == LlamaFamilyConfig(attention_bias=True)
    qwen2 = llama_like("Qwen2ForCausalLM", attention_bias=False)
    assert qwen2.family == LlamaFamilyConfig(attention_bias=False)
    assert llama_like("Qwen3ForCausalLM").family == LlamaFamilyConfig(qk_norm=True)
    assert llama.head_size == 32 and llama.num_kv_heads == 1 and llama.hidden_act == "silu"


def test_opt_and_gpt2_read_their_own_names() -> None:
    opt = model_config_from_hf(OPT)
    assert opt.family == LearnedPositionConfig(norm_before=True, position_offset=2)
    assert (opt.intermediate_size, opt.max_position_embeddings, opt.hidden_act) == (
        128, 2048, "relu"
    )  # fmt: skip
    post_ln = model_config_from_hf({**OPT, "do_layer_norm_before": False})
    assert post_ln.family == LearnedPositionConfig(norm_before=False, position_offset=2)
    gpt2 = model_config_from_hf(GPT2)
    assert gpt2.family == LearnedPositionConfig(norm_before=True, position_offset=0)
    assert (gpt2.hidden_size, gpt2.intermediate_size, gpt2.max_position_embeddings) == (
        64, 256, 1024
    )  # fmt: skip
    assert gpt2.tie_word_embeddings and gpt2.hidden_act == "gelu_new"
    with pytest.raises(ValueError, match="the config lacks 'n_embd'"):
        model_config_from_hf({k: v for k, v in GPT2.items() if k != "n_embd"})


def test_a_config_made_without_switches_has_its_family_defaults() -> None:
    plain = replace(llama_like("LlamaForCausalLM"), family=FamilyConfig())
    assert plain.family_config(LlamaFamilyConfig) == LlamaFamilyConfig()
    assert plain.family_config(LearnedPositionConfig) == LearnedPositionConfig()
    with pytest.raises(TypeError, match="carries LlamaFamilyConfig, not the LearnedPositionConfig"):
        llama_like("Qwen3ForCausalLM").family_config(LearnedPositionConfig)


def test_an_architecture_that_is_no_name_is_refused_by_name() -> None:
    # A regression: a list in `architectures` reached a dict lookup and was refused as
    # "unhashable type", not as an architecture pyengine does not run.
    with pytest.raises(ValueError, match=r"architecture \['x'\] is not supported; pyengine runs"):
        model_config_from_hf({"architectures": [["x"]]})


def test_the_layers_with_experts_are_those_each_family_names() -> None:
    from pyengine.models.llama_moe import sparse_layers

    assert sparse_layers({}, 4) == (0, 1, 2, 3)
    assert sparse_layers({"decoder_sparse_step": 2, "mlp_only_layers": [3]}, 6) == (1, 5)
    assert sparse_layers({"first_k_dense_replace": 3}, 6) == (3, 4, 5)  # (DeepSeek's)
    assert sparse_layers({"first_k_dense_replace": 1, "moe_layer_freq": 2}, 6) == (2, 4)
