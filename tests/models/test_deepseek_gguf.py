"""DeepSeek-V2 and V3 from GGUF files written in the test as llama.cpp's conversion writes
them (its deepseek2 architecture), from the weights of tiny random transformers models:
V2 with q_proj whole, kv_b_proj whole (the older files) and softmax routing limited to
its top groups; V3 through q_lora_rank, kv_b_proj as attn_k_b (transposed) and attn_v_b
(llama.cpp's MLA form, with its MLA head sizes), sigmoid routing with its correction bias
(exp_probs_b) and YaRN kept as yarn_log_multiplier; the experts in Q8_0 blocks. The
config read from the file is the one read from the Hugging Face folder, and the greedy
float32 tokens are transformers'."""

from __future__ import annotations

from dataclasses import replace
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
from helpers.tiny_deepseek import deepseek_config, random_deepseek  # noqa: E402

# (sizes of whole Q8_0 blocks for the experts: hidden 64, their intermediate 32)
OVERRIDES = dict(vocab_size=VOCAB, eos_token_id=EOS, bos_token_id=None, pad_token_id=None)
LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}  # fmt: skip


def config(version: str):  # type: ignore[no-untyped-def]
    c = deepseek_config(version, **OVERRIDES)
    if version == "v3":  # (llama.cpp keeps mscale_all_dim alone: DeepSeek's mscale is it)
        c.rope_parameters["mscale"] = c.rope_parameters["mscale_all_dim"]
    return c


def write_deepseek_gguf(path: Path, version: str, hf_folder: Path) -> torch.nn.Module:
    c = config(version)
    model = random_deepseek(c)
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    v3 = version == "v3"
    rope, nope, v, rank = c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    for add, value in (
        (writer.add_block_count, c.num_hidden_layers), (writer.add_context_length, 256),
        (writer.add_embedding_length, c.hidden_size),
        (writer.add_feed_forward_length, c.intermediate_size),
        (writer.add_head_count, c.num_attention_heads),
        (writer.add_layer_norm_rms_eps, c.rms_norm_eps), (writer.add_rope_freq_base, 10000.0),
        (writer.add_rope_dimension_count, rope), (writer.add_kv_lora_rank, rank),
        (writer.add_leading_dense_block_count, c.first_k_dense_replace),
        (writer.add_expert_feed_forward_length, c.moe_intermediate_size),
        (writer.add_expert_count, c.n_routed_experts),
        (writer.add_expert_used_count, c.num_experts_per_tok),
        (writer.add_expert_shared_count, c.n_shared_experts),
        (writer.add_expert_weights_scale, c.routed_scaling_factor),
        (writer.add_expert_weights_norm, c.norm_topk_prob),
        (writer.add_expert_group_count, c.n_group),
        (writer.add_expert_group_used_count, c.topk_group),
        
    ):  # fmt: skip
        add(value)
    add_byte_tokenizer(writer)

    if v3:  # (the MLA form's head sizes: the latent's as MQA, the heads' own apart)
        writer.add_q_lora_rank(c.q_lora_rank)
        writer.add_head_count_kv(1)
        writer.add_key_length(rank + rope)
        writer.add_value_length(rank)
        writer.add_key_length_mla(nope + rope)
        writer.add_value_length_mla(v)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        yarn = c.rope_parameters
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(yarn["factor"])
        writer.add_rope_scaling_orig_ctx_len(yarn["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * yarn["mscale_all_dim"])
    else:
        writer.add_head_count_kv(c.num_attention_heads)
        writer.add_key_length(nope + rope)
        writer.add_value_length(v)

    def add(name: str, values: torch.Tensor, blocks: bool = False) -> None:
        if blocks:
            add_q8_0(writer, name, values)
        else:
            writer.add_tensor(name, values.numpy().copy())

    with torch.no_grad():
        add("token_embd.weight", params["model.embed_tokens.weight"])
        add("output_norm.weight", params["model.norm.weight"])
        add("output.weight", params["lm_head.weight"])
        for i in range(c.num_hidden_layers):
            prefix = f"model.layers.{i}"
            for hf, name in LAYER.items():
                if f"{prefix}.{hf}.weight" in params:
                    add(f"blk.{i}.{name}.weight", params[f"{prefix}.{hf}.weight"])
            bias = f"{prefix}.mlp.gate.e_score_correction_bias"
            if bias in params:
                add(f"blk.{i}.exp_probs_b.bias", params[bias])
            kv_b = params[f"{prefix}.self_attn.kv_b_proj.weight"]
            if v3:  # (llama.cpp's split: k_b [heads, rank, nope], v_b [heads, v, rank])
                per_head = kv_b.view(c.num_attention_heads, nope + v, rank)
                add(f"blk.{i}.attn_k_b.weight", per_head[:, :nope].transpose(1, 2).contiguous())
                add(f"blk.{i}.attn_v_b.weight", per_head[:, nope:].contiguous())
            else:
                add(f"blk.{i}.attn_kv_b.weight", kv_b)
            gate_up = f"{prefix}.mlp.experts.gate_up_proj"
            if gate_up in params:  # [experts, 2 n, hidden]: gate's rows, then up's
                n = c.moe_intermediate_size
                gate, up = params[gate_up][:, :n].clone(), params[gate_up][:, n:].clone()
                down = params[f"{prefix}.mlp.experts.down_proj"]
                for name, values in (("gate", gate), ("up", up), ("down", down)):
                    add(f"blk.{i}.ffn_{name}_exps.weight", values, blocks=True)
                params[gate_up].copy_(torch.cat((gate, up), dim=1))
    close(writer)
    model.save_pretrained(hf_folder)
    return model


@pytest.fixture(scope="module", params=["v2", "v3"])
def deepseek_gguf(request, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp(f"deepseek-gguf-{request.param}")
    model = write_deepseek_gguf(root / "model.gguf", request.param, root / "hf")
    return root / "model.gguf", root / "hf", model


ENGINE = dict(max_model_len=256, kv_cache_memory=32 * 2**20, dtype="float32")


def test_the_file_gives_the_folders_config_and_transformers_tokens(deepseek_gguf) -> None:  # type: ignore[no-untyped-def]
    path, folder, model = deepseek_gguf
    llm, got, want = file_and_folder(path, folder, ENGINE)
    assert got.architecture == want.architecture
    # (heads' sizes, routing, groups; the softmax scale to the float32 the file keeps
    # mscale_all_dim in)
    scale = want.family.softmax_scale
    assert replace(got.family, softmax_scale=scale) == want.family
    assert got.family.softmax_scale == pytest.approx(scale, rel=1e-6)
    assert got.head_size == want.head_size and got.rope_theta == want.rope_theta
    scaling = ("rope_type", "factor", "original_max_position_embeddings")
    assert {k: (got.rope_scaling or {}).get(k) for k in scaling} == {
        k: (want.rope_scaling or {}).get(k) for k in scaling
    }
    mscale = (want.rope_scaling or {}).get("mscale_all_dim")  # (V3's YaRN; V2 has none)
    expected = None if mscale is None else pytest.approx(mscale, rel=1e-6)
    assert (got.rope_scaling or {}).get("mscale_all_dim") == expected
    experts = llm.llm_engine.executor.driver_worker.model_runner.model.layers[1].mlp
    assert experts.weight_form() == "8-bit blocks experts"
    assert_transformers_tokens(llm, model)
