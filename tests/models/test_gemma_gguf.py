"""Gemma 2 and Gemma 3 from GGUF files written in the test as llama.cpp's conversion
writes them (its gemma2 and gemma3 architectures: norms stored as 1 + w, the sliding
pattern and Gemma 3's local rotary base left to llama.cpp's defaults, Gemma 2's
soft-caps in the metadata), from the weights of a tiny random transformers model, some
matrices in Q8_0 blocks: the config read from the file is the one read from the
Hugging Face folder, and the greedy float32 tokens are transformers', past the window."""

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

WINDOW = 16
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=256, sliding_window=WINDOW,
    query_pre_attn_scalar=32, eos_token_id=EOS, rms_norm_eps=1e-6,
)  # fmt: skip
CONFIGS = {
    "gemma2": lambda: transformers.Gemma2Config(
        **SHAPE, num_hidden_layers=4, attn_logit_softcapping=3.0, final_logit_softcapping=5.0
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SHAPE, num_hidden_layers=6, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        },
    ),
}  # fmt: skip
GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip
GEMMA3_LAYER = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Matrices held as Q8_0 blocks (the others float32), as a quantized file mixes them.
BLOCKS = ("attn_q", "ffn_down")


def write_gemma_gguf(path: Path, arch: str, hf_folder: Path) -> torch.nn.Module:
    """The GGUF file of a random model of CONFIGS[arch] (also saved to hf_folder, with the
    same weights); the model, holding the values the file does."""
    torch.manual_seed(0)
    config = CONFIGS[arch]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    writer = gguf.GGUFWriter(str(path), arch)
    for add, value in (
        (writer.add_block_count, config.num_hidden_layers), (writer.add_context_length, 256),
        (writer.add_embedding_length, 64), (writer.add_feed_forward_length, 96),
        (writer.add_head_count, 4), (writer.add_head_count_kv, 2), (writer.add_key_length, 32),
        (writer.add_value_length, 32), (writer.add_layer_norm_rms_eps, 1e-6),
        (writer.add_sliding_window, WINDOW),
    ):  # fmt: skip
        add(value)
    add_byte_tokenizer(writer)
    if arch == "gemma2":
        writer.add_rope_freq_base(10000.0)
        writer.add_attn_logit_softcapping(3.0)
        writer.add_final_logit_softcapping(5.0)
    else:  # (the sliding layers' base left to llama.cpp's default, 10000)
        writer.add_rope_freq_base(1e6)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)
    params = dict(model.named_parameters())

    def tensor(name: str, hf: str) -> None:
        """Norms as llama.cpp stores them (1 + w, w random about 0); matrices random,
        BLOCKS' in Q8_0."""
        kind = name.split(".")[-2]
        if "norm" in name:
            stored = (1 + torch.randn(params[hf].shape) * 0.3).numpy()
            writer.add_tensor(name, stored)
            values = torch.from_numpy(stored) - 1
        elif kind in BLOCKS:
            values = torch.randn(params[hf].shape) * 0.08
            add_q8_0(writer, name, values)
        else:
            values = torch.randn(params[hf].shape) * 0.08
            writer.add_tensor(name, values.numpy())
        with torch.no_grad():
            params[hf].copy_(values)

    for name, hf in GLOBAL.items():
        tensor(f"{name}.weight", f"{hf}.weight")
    layer = {**LAYER, **(GEMMA3_LAYER if arch == "gemma3" else {})}
    for i in range(config.num_hidden_layers):
        for name, hf in layer.items():
            tensor(f"blk.{i}.{name}.weight", f"model.layers.{i}.{hf}.weight")
    close(writer)
    model.save_pretrained(hf_folder)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def gemma_gguf(request, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp(request.param)
    model = write_gemma_gguf(root / "model.gguf", request.param, root / "hf")
    return root / "model.gguf", root / "hf", model


ENGINE = dict(max_model_len=256, kv_cache_memory=32 * 2**20, dtype="float32")


def test_the_file_gives_the_folders_config_and_transformers_tokens(gemma_gguf) -> None:  # type: ignore[no-untyped-def]
    path, folder, model = gemma_gguf
    llm, got, want = file_and_folder(path, folder, ENGINE)
    assert got.family == want.family  # (windows, scales, soft-caps, local rotary base)
    assert (got.rope_theta, got.sliding_window) == (want.rope_theta, want.sliding_window)
    scaling = ("rope_type", "factor")  # (the folder's also repeats its theta)
    assert {k: (got.rope_scaling or {}).get(k) for k in scaling} == {
        k: (want.rope_scaling or {}).get(k) for k in scaling
    }
    layer = llm.llm_engine.executor.driver_worker.model_runner.model.layers[0]
    # (Q8_0's blocks held, not floats; q in blocks beside float k and v is dequantized)
    assert layer.mlp.down_proj.method.keeps_blocks
    assert not layer.self_attn.qkv_proj.method.keeps_blocks
    assert_transformers_tokens(llm, model, new=20)
