"""gpt-oss from GGUF files written in the test as llama.cpp's conversion writes them (its
gpt-oss architecture): the experts' gate and up apart, in MXFP4 blocks (the gguf
package's own quantizer), each with its bias; the sinks, the router and its bias; YaRN
in the metadata; windows on every other layer. The config read from the file is the one
read from the Hugging Face folder, and the greedy float32 tokens are transformers' on the
weights the gguf package dequantizes; the experts stay 8-bit blocks of the same values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from helpers.byte_tokenizer import EOS, VOCAB  # noqa: E402
from helpers.gguf_writing import (  # noqa: E402
    add_byte_tokenizer,
    assert_transformers_tokens,
    close,
    file_and_folder,
)
from helpers.tiny_gpt_oss import random_gpt_oss  # noqa: E402

LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp",
}  # fmt: skip
ENGINE = dict(max_model_len=256, kv_cache_memory=32 * 2**20, dtype="float32")


def write_gpt_oss_gguf(path: Path, hf_folder: Path) -> torch.nn.Module:
    model = random_gpt_oss(
        vocab_size=VOCAB, eos_token_id=EOS, bos_token_id=None, pad_token_id=None,
        intermediate_size=64, swiglu_limit=0.625, tie_word_embeddings=False,
    )  # fmt: skip
    c, params = model.config, dict(model.named_parameters())
    yarn = c.rope_parameters
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    for add, value in (
        (writer.add_block_count, 2), (writer.add_context_length, 256),
        (writer.add_embedding_length, 64), (writer.add_feed_forward_length, 64),
        (writer.add_expert_feed_forward_length, 64), (writer.add_head_count, 4),
        (writer.add_head_count_kv, 2), (writer.add_key_length, 32), (writer.add_value_length, 32),
        (writer.add_layer_norm_rms_eps, c.rms_norm_eps),
        (writer.add_rope_freq_base, yarn["rope_theta"]),
        (writer.add_rope_scaling_type, gguf.RopeScalingType.YARN),
        (writer.add_rope_scaling_factor, yarn["factor"]),
        (writer.add_rope_scaling_orig_ctx_len, yarn["original_max_position_embeddings"]),
        (writer.add_sliding_window, 16), (writer.add_expert_count, 8),
        (writer.add_expert_used_count, 2), 
    ):  # fmt: skip
        add(value)
    add_byte_tokenizer(writer)

    writer.add_float32("gpt-oss.swiglu_clamp_exp", 0.625)  # (exact in float32)

    def add_tensor(name: str, values: torch.Tensor) -> None:
        writer.add_tensor(name, values.detach().numpy().copy())

    with torch.no_grad():
        add_tensor("token_embd.weight", params["model.embed_tokens.weight"])
        add_tensor("output_norm.weight", params["model.norm.weight"])
        add_tensor("output.weight", params["lm_head.weight"])
        for i in range(2):
            prefix = f"model.layers.{i}"
            for hf, name in LAYER.items():
                add_tensor(f"blk.{i}.{name}.weight", params[f"{prefix}.{hf}.weight"])
                if f"{prefix}.{hf}.bias" in params:
                    add_tensor(f"blk.{i}.{name}.bias", params[f"{prefix}.{hf}.bias"])
            add_tensor(f"blk.{i}.attn_sinks.weight", params[f"{prefix}.self_attn.sinks"])
            # transformers: gate_up [experts, hidden, 2 n] with gate and up columns
            # alternating, down [experts, n, hidden]; llama.cpp: [experts, rows, in] apart
            gate_up = params[f"{prefix}.mlp.experts.gate_up_proj"]
            bias = params[f"{prefix}.mlp.experts.gate_up_proj_bias"]
            down = params[f"{prefix}.mlp.experts.down_proj"]
            parts = {"gate": gate_up[..., 0::2].transpose(1, 2), "up": gate_up[..., 1::2]
                     .transpose(1, 2), "down": down.transpose(1, 2)}  # fmt: skip
            values = {}
            for name, w in parts.items():
                blocks = quantize(w.contiguous().numpy(), Q.MXFP4)
                writer.add_tensor(f"blk.{i}.ffn_{name}_exps.weight", blocks, raw_dtype=Q.MXFP4)
                values[name] = torch.from_numpy(dequantize(blocks, Q.MXFP4).reshape(w.shape).copy())
            add_tensor(f"blk.{i}.ffn_gate_exps.bias", bias[:, 0::2])
            add_tensor(f"blk.{i}.ffn_up_exps.bias", bias[:, 1::2])
            add_tensor(
                f"blk.{i}.ffn_down_exps.bias", params[f"{prefix}.mlp.experts.down_proj_bias"]
            )
            gate_up[..., 0::2] = values["gate"].transpose(1, 2)
            gate_up[..., 1::2] = values["up"].transpose(1, 2)
            down.copy_(values["down"].transpose(1, 2))
    close(writer)
    model.save_pretrained(hf_folder)
    return model


@pytest.fixture(scope="module")
def gpt_oss_gguf(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("gpt-oss-gguf")
    model = write_gpt_oss_gguf(root / "model.gguf", root / "hf")
    return root / "model.gguf", root / "hf", model


def test_the_file_gives_the_folders_config_and_transformers_tokens(gpt_oss_gguf) -> None:  # type: ignore[no-untyped-def]
    path, folder, model = gpt_oss_gguf
    llm, got, want = file_and_folder(path, folder, ENGINE)
    assert got.family == want.family  # (windows, experts, the clamped SwiGLU's limit)
    assert (got.rope_theta, got.head_size) == (want.rope_theta, want.head_size)
    keys = ("rope_type", "factor", "original_max_position_embeddings", "truncate")
    assert {k: got.rope_scaling.get(k) for k in keys} == {k: want.rope_scaling.get(k) for k in keys}
    layers = llm.llm_engine.executor.driver_worker.model_runner.model.layers
    assert [layer.mlp.weight_form() for layer in layers] == ["8-bit blocks experts"] * 2
    assert_transformers_tokens(llm, model)
