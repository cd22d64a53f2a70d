"""Phi-3 from GGUF files written in the test as llama.cpp's conversion writes them (its
phi3 architecture: q/k/v fused in attn_qkv, gate and up in ffn_up, LongRoPE's factors as
the tensors rope_factors_long and rope_factors_short beside the original context and the
attention factor, the sliding window in the metadata), from the weights of a tiny random
transformers model, its matrices in Q8_0: the config read from the file is the one read
from the Hugging Face folder, and the greedy float32 tokens are transformers', within the
original context (the short factors) and past it (the long ones)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
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

from pyengine.layers.rotary import attention_factor  # noqa: E402

ORIGINAL, CONTEXT, WINDOW = 64, 256, 48
LAYER = {
    "input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def write_phi3_gguf(path: Path, hf_folder: Path) -> torch.nn.Module:
    rng = np.random.default_rng(0)
    scaling = {"type": "longrope", "short_factor": (1 + rng.random(16)).tolist(),
               "long_factor": (2 + 6 * rng.random(16)).tolist()}  # fmt: skip
    c = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        original_max_position_embeddings=ORIGINAL, rope_scaling=scaling, sliding_window=WINDOW,
        eos_token_id=EOS, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(c, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.08)
    writer = gguf.GGUFWriter(str(path), "phi3")
    for add, value in (
        (writer.add_block_count, 2), (writer.add_context_length, CONTEXT),
        (writer.add_embedding_length, 128), (writer.add_feed_forward_length, 256),
        (writer.add_head_count, 4), (writer.add_head_count_kv, 2),
        (writer.add_layer_norm_rms_eps, c.rms_norm_eps), (writer.add_rope_dimension_count, 32),
        (writer.add_rope_freq_base, 10000.0), (writer.add_sliding_window, WINDOW),
        (writer.add_rope_scaling_orig_ctx_len, ORIGINAL),
        (writer.add_rope_scaling_attn_factors,
         math.sqrt(1 + math.log(CONTEXT / ORIGINAL) / math.log(ORIGINAL))),
        
    ):  # fmt: skip
        add(value)
    add_byte_tokenizer(writer)

    for name in ("long", "short"):
        factors = np.array(scaling[f"{name}_factor"], dtype=np.float32)
        writer.add_tensor(f"rope_factors_{name}.weight", factors)
    with torch.no_grad():
        for name, hf in (("token_embd", "model.embed_tokens"), ("output_norm", "model.norm"),
                         ("output", "lm_head")):  # fmt: skip
            writer.add_tensor(f"{name}.weight", params[f"{hf}.weight"].numpy().copy())
        for i in range(2):
            for hf, name in LAYER.items():
                w = params[f"model.layers.{i}.{hf}.weight"]
                if w.dim() == 1:
                    writer.add_tensor(f"blk.{i}.{name}.weight", w.numpy().copy())
                    continue
                add_q8_0(writer, f"blk.{i}.{name}.weight", w)
    close(writer)
    model.save_pretrained(hf_folder)
    return model


@pytest.fixture(scope="module")
def phi3_gguf(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("phi3-gguf")
    return root / "model.gguf", root / "hf", write_phi3_gguf(root / "model.gguf", root / "hf")


@pytest.mark.parametrize("max_model_len", [ORIGINAL, CONTEXT], ids=["short", "long"])
def test_the_file_gives_the_folders_config_and_transformers_tokens(
    phi3_gguf, max_model_len: int
) -> None:  # type: ignore[no-untyped-def]
    path, folder, model = phi3_gguf
    engine = dict(max_model_len=max_model_len, kv_cache_memory=16 * 2**20, dtype="float32")
    llm, got, want = file_and_folder(path, folder, engine)
    assert (got.family, got.sliding_window, got.head_size) == (
        want.family, want.sliding_window, want.head_size,
    )  # fmt: skip
    keys = ("rope_type", "original_max_position_embeddings", "factor")
    assert {k: got.rope_scaling[k] for k in keys} == {k: want.rope_scaling[k] for k in keys}
    for name in ("long_factor", "short_factor"):  # (float32 in the file)
        assert got.rope_scaling[name] == pytest.approx(want.rope_scaling[name], rel=1e-6)
    assert attention_factor(got.rope_scaling) == pytest.approx(attention_factor(want.rope_scaling))
    lengths, new = ((5, 30), 12) if max_model_len == ORIGINAL else ((70, 120), 20)
    assert_transformers_tokens(llm, model, lengths, new)
