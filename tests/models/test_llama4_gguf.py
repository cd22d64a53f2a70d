"""Llama 4 (text) from GGUF files written in the test as llama.cpp's conversion writes them
(its llama4 architecture: q/k rows as Hugging Face holds them, the experts a tensor per
part for every expert in Q8_0 blocks, the shared expert apart), from the weights of a
tiny random transformers model whose config takes the values llama.cpp fixes (chunks of
8192, a NoPE layer in four, the temperature's floor and scale, the weightless q/k norm).
The config read from the file is the one read from the Hugging Face folder, and the
greedy float32 tokens are transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from helpers.byte_tokenizer import EOS, VOCAB  # noqa: E402
from helpers.gguf_writing import (  # noqa: E402
    add_byte_tokenizer,
    add_q8_0,
    assert_transformers_tokens,
    close,
    file_and_folder,
)

LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "feed_forward.gate_proj": "ffn_gate",
    "feed_forward.up_proj": "ffn_up", "feed_forward.down_proj": "ffn_down",
    "feed_forward.router": "ffn_gate_inp",
    "feed_forward.shared_expert.gate_proj": "ffn_gate_shexp",
    "feed_forward.shared_expert.up_proj": "ffn_up_shexp",
    "feed_forward.shared_expert.down_proj": "ffn_down_shexp",
}  # fmt: skip
ENGINE = dict(max_model_len=256, kv_cache_memory=32 * 2**20, dtype="float32")


def write_llama4_gguf(path: Path, hf_folder: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    c = transformers.Llama4TextConfig(
        vocab_size=VOCAB, eos_token_id=EOS, bos_token_id=None, pad_token_id=None,
        hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
        attention_chunk_size=8192, no_rope_layer_interval=4, floor_scale=8192, attn_scale=0.1,
        use_qk_norm=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )  # fmt: skip
    model = transformers.Llama4ForCausalLM(c).to(torch.float32).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.08)
    writer = gguf.GGUFWriter(str(path), "llama4")
    for add, value in (
        (writer.add_block_count, 4), (writer.add_context_length, 256),
        (writer.add_embedding_length, 64), (writer.add_feed_forward_length, 96),
        (writer.add_expert_feed_forward_length, 32), (writer.add_head_count, 4),
        (writer.add_head_count_kv, 2), (writer.add_key_length, 32), (writer.add_value_length, 32),
        (writer.add_layer_norm_rms_eps, c.rms_norm_eps), (writer.add_rope_freq_base, 500000.0),
        (writer.add_expert_count, 4), (writer.add_expert_used_count, 1),
        (writer.add_interleave_moe_layer_step, 2), 
    ):  # fmt: skip
        add(value)
    add_byte_tokenizer(writer)

    with torch.no_grad():
        for name, hf in (("token_embd", "model.embed_tokens"), ("output_norm", "model.norm"),
                         ("output", "lm_head")):  # fmt: skip
            writer.add_tensor(f"{name}.weight", params[f"{hf}.weight"].numpy().copy())
        for i in range(4):
            prefix = f"model.layers.{i}"
            for hf, name in LAYER.items():
                if f"{prefix}.{hf}.weight" in params:
                    values = params[f"{prefix}.{hf}.weight"].numpy().copy()
                    writer.add_tensor(f"blk.{i}.{name}.weight", values)
            gate_up = params.get(f"{prefix}.feed_forward.experts.gate_up_proj")
            if gate_up is None:
                continue
            # transformers: gate_up [experts, hidden, 2 n] (gate's columns first), down
            # [experts, n, hidden]; llama.cpp: [experts, rows, in] a part, here in Q8_0
            down = params[f"{prefix}.feed_forward.experts.down_proj"]
            n = c.intermediate_size
            parts = {"gate": gate_up[..., :n], "up": gate_up[..., n:], "down": down}
            for name, w in parts.items():  # (the views take the dequantized values)
                add_q8_0(writer, f"blk.{i}.ffn_{name}_exps.weight", w.transpose(1, 2))
    close(writer)
    model.save_pretrained(hf_folder)
    return model


def test_the_file_gives_the_folders_config_and_transformers_tokens(tmp_path: Path) -> None:
    model = write_llama4_gguf(tmp_path / "model.gguf", tmp_path / "hf")
    llm, got, want = file_and_folder(tmp_path / "model.gguf", tmp_path / "hf", ENGINE)
    assert got.family == want.family  # (chunks, NoPE layers, temperature, q/k norm, experts)
    assert (got.rope_theta, got.rope_scaling, got.head_size) == (
        want.rope_theta, want.rope_scaling, want.head_size,
    )  # fmt: skip
    layers = llm.llm_engine.executor.driver_worker.model_runner.model.layers
    assert [layers[i].mlp.weight_form() for i in (1, 3)] == ["8-bit blocks experts"] * 2
    assert_transformers_tokens(llm, model)
