"""Llama 4 (text) from a 4-bit GPTQ checkpoint written in the test from a tiny random
transformers one: every projection quantized (attention, the dense MLPs, each expert an
expert at a time, as quantized checkpoints name them, and the shared expert), the router
float. The weight-only arithmetic is the dequantized weights', so the greedy float32
tokens are transformers' on them."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.hf_reference import hf_greedy
from helpers.quantized_checkpoints import write_quantized
from safetensors.torch import load_file, save_file

from pyengine import LLM, SamplingParams
from pyengine.layers.quantization.weight_only_int import WeightOnlyIntMethod

transformers = pytest.importorskip("transformers")

ENGINE = dict(max_model_len=128, kv_cache_memory=16 * 2**20, dtype="float32")
EXPERTS = "feed_forward.experts"


def config() -> object:
    return transformers.Llama4TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, attention_chunk_size=16, no_rope_layer_interval=4,
        floor_scale=8, attn_scale=0.5, use_qk_norm=True, tie_word_embeddings=False,
    )  # fmt: skip


def per_expert(tensors: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """transformers' fused experts ([experts, hidden, 2 n] and [experts, n, hidden]) an
    expert at a time, [out, in] each."""
    out = {}
    for name, t in tensors.items():
        module = name.removesuffix(f".{EXPERTS}.gate_up_proj").removesuffix(
            f".{EXPERTS}.down_proj")  # fmt: skip
        if name.endswith(f"{EXPERTS}.gate_up_proj"):
            for e in range(t.shape[0]):
                out[f"{module}.{EXPERTS}.{e}.gate_proj.weight"] = t[e, :, :n].t().contiguous()
                out[f"{module}.{EXPERTS}.{e}.up_proj.weight"] = t[e, :, n:].t().contiguous()
        elif name.endswith(f"{EXPERTS}.down_proj"):
            for e in range(t.shape[0]):
                out[f"{module}.{EXPERTS}.{e}.down_proj.weight"] = t[e].t().contiguous()
        else:
            out[name] = t
    return out


def fused(tensors: dict[str, torch.Tensor], experts: int) -> dict[str, torch.Tensor]:
    """The inverse: each layer's experts back in transformers' fused tensors."""
    out = {k: v for k, v in tensors.items() if f".{EXPERTS}." not in k}
    layers = {k.split(f".{EXPERTS}.")[0] for k in tensors if f".{EXPERTS}." in k}
    for module in layers:
        rows = {p: [tensors[f"{module}.{EXPERTS}.{e}.{p}.weight"].t() for e in range(experts)]
                for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
        pairs = zip(rows["gate_proj"], rows["up_proj"], strict=True)
        gate_up = [torch.cat(pair, dim=1) for pair in pairs]
        out[f"{module}.{EXPERTS}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{module}.{EXPERTS}.down_proj"] = torch.stack(rows["down_proj"])
    return out


def test_a_gptq_checkpoint_gives_the_dequantized_models_tokens(tmp_path: Path) -> None:
    torch.manual_seed(0)
    c = config()
    model = transformers.Llama4ForCausalLM(c).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.08)
    model.eval().save_pretrained(tmp_path / "float")
    split = tmp_path / "split"
    shutil.copytree(tmp_path / "float", split)
    tensors = load_file(str(split / "model.safetensors"))
    save_file(per_expert(tensors, c.intermediate_size), str(split / "model.safetensors"))
    write_quantized(split, tmp_path / "q", tmp_path / "ref", "gptq", 4, 32)
    reference = load_file(str(tmp_path / "ref" / "model.safetensors"))
    save_file(fused(reference, c.num_local_experts), str(tmp_path / "ref" / "model.safetensors"))

    llm = LLM(str(tmp_path / "q"), **ENGINE)
    layers = llm.llm_engine.executor.driver_worker.model_runner.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj.method, WeightOnlyIntMethod)
    assert layers[1].mlp.weight_form() == "4-bit blocks experts"  # (stacked for the kernel)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.shutdown()
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(want, p, 12) for p in prompts]
