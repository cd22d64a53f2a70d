"""gpt-oss's released form: its experts MXFP4 (`quant_method: mxfp4`), written in the test
from a tiny random transformers checkpoint by an MXFP4 quantizer of the test's own (each
32 weights of a row scaled by a power of two, each weight rounded to the nearest e2m1
value, two codes a byte). The reference is transformers on the weights transformers'
own MXFP4 dequantizer gives. On the CPU in float32 the experts stay 8-bit blocks of the
same values (greedy tokens identical to transformers'); in bfloat16 they are dequantized
at load (the dequantized checkpoint's tokens); over two ranks, one rank's tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.hf_reference import assert_ranks_give_one_ranks_tokens, hf_greedy
from helpers.tiny_gpt_oss import random_gpt_oss
from safetensors.torch import load_file, save_file

from pyengine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")
mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

ENGINE = dict(max_model_len=256, kv_cache_memory=32 * 2**20, dtype="float32")
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def quantize_mxfp4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., r, c] as MXFP4: (blocks [..., r, c / 32, 16] uint8, scales [..., r,
    c / 32] uint8): a block's scale 2^k the least with max|w| / 2^k <= 6, each weight the
    nearest e2m1 value (the sign in the nibble's high bit), the even weight low."""
    w = rows.double().numpy().reshape(*rows.shape[:-1], -1, 32)
    amax = np.abs(w).max(axis=-1, keepdims=True)
    k = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6))
    scaled = w / 2.0**k
    codes = np.abs(np.abs(scaled)[..., None] - E2M1).argmin(axis=-1) + 8 * (scaled < 0)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    scales = np.ascontiguousarray((k[..., 0] + 127).astype(np.uint8))
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(scales)


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the MXFP4 checkpoint, the float one of its dequantized weights)."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    # (an intermediate size of whole MXFP4 blocks of 32)
    random_gpt_oss(intermediate_size=64).save_pretrained(root / "float")
    tensors = load_file(str(root / "float" / "model.safetensors"))
    quantized, reference = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # (transformers holds [experts, in, out]; MXFP4 rows are the outputs)
        blocks, scales = quantize_mxfp4(tensors[name].transpose(1, 2))
        del quantized[name]
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        dequantized = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        reference[name] = dequantized.contiguous()
    for folder, weights in ((root / "q", quantized), (root / "ref", reference)):
        shutil.copytree(root / "float", folder)
        save_file(weights, str(folder / "model.safetensors"))
    raw = json.loads((root / "float" / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (root / "q" / "config.json").write_text(json.dumps(raw))
    return root / "q", root / "ref"


PROMPTS = [list(range(3, 60)), [9, 8, 7], list(range(100, 130))]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def tokens(folder: Path, **engine: object) -> tuple[list[list[int]], list[str | None]]:
    llm = LLM(str(folder), **{**ENGINE, **engine})
    model = llm.llm_engine.executor.driver_worker.model_runner.model
    forms = [layer.mlp.weight_form() for layer in model.layers]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    llm.llm_engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], forms


def test_mxfp4_experts_run_as_8_bit_blocks_of_the_same_values(mxfp4_gpt_oss) -> None:  # type: ignore[no-untyped-def]
    folder, reference = mxfp4_gpt_oss
    got, forms = tokens(folder)
    assert forms == ["8-bit blocks experts"] * 2
    model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    assert got == [hf_greedy(model, p, PARAMS.max_tokens) for p in PROMPTS]


def test_mxfp4_experts_in_bfloat16_are_dequantized_at_load(mxfp4_gpt_oss) -> None:  # type: ignore[no-untyped-def]
    folder, reference = mxfp4_gpt_oss
    got, forms = tokens(folder, dtype="bfloat16")
    assert forms == ["bfloat16 expert panels"] * 2
    assert got == tokens(reference, dtype="bfloat16")[0]


@pytest.mark.slow
def test_two_ranks_give_one_ranks_tokens(mxfp4_gpt_oss) -> None:  # type: ignore[no-untyped-def]
    """Each rank's experts (expert parallelism) or its 32 intermediate features of each
    (whole blocks of the down projection)."""
    layouts = [{"tensor_parallel_size": 2},
               {"tensor_parallel_size": 2, "enable_expert_parallel": True}]  # fmt: skip
    assert_ranks_give_one_ranks_tokens(mxfp4_gpt_oss[0], ENGINE, layouts)
