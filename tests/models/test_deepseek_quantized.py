"""Quantized DeepSeek checkpoints, written in the test from tiny random ones that
transformers makes: DeepSeek-V3's own FP8 form (the `fp8` quant_method: e4m3 weights
with a scale per block of [out, in], activations quantized per group of inputs as each
step runs), and GPTQ through the existing methods. Every projection of the latent
attention and the experts is quantized; kv_b_proj, which the absorbed products read as
float, is dequantized once loaded. References: transformers on the dequantized weights
(weight-only: the same tokens), float64 products of the e4m3 values, and the dequantized
model within what e4m3 activations cost."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.hf_reference import assert_ranks_give_one_ranks_tokens, hf_greedy
from helpers.logprobs import same_context_differences
from helpers.quantized_checkpoints import block_scales, write_fp8_blocks, write_quantized
from helpers.tiny_deepseek import deepseek_checkpoint, deepseek_config
from safetensors.torch import load_file

from pyengine import LLM, SamplingParams
from pyengine.layers.quantization.fp8_w8a8 import FP8, Fp8Method
from pyengine.layers.quantization.weight_only_int import WeightOnlyIntMethod

transformers = pytest.importorskip("transformers")

# Inputs of whole blocks of 32 (and of 32 a rank over two): q_lora_rank, the heads'
# values, the dense and the experts' intermediate sizes.
SIZES = dict(q_lora_rank=64, v_head_dim=32, intermediate_size=128, moe_intermediate_size=64)
BLOCK = (32, 32)
ENGINE = dict(max_model_len=128, kv_cache_memory=16 * 2**20, dtype="float32")
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, n).tolist() for n in (4, 30, 70)]


def outputs(folder: Path, **engine_args: object) -> list:  # type: ignore[type-arg]
    llm = LLM(str(folder), **{**ENGINE, **engine_args})
    try:
        result = llm.generate([{"prompt_token_ids": p} for p in prompts()], PARAMS, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in result]
    finally:
        llm.llm_engine.shutdown()


def transformers_tokens(reference: Path) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    return [hf_greedy(model, p, PARAMS.max_tokens) for p in prompts()]


@pytest.fixture(scope="module", params=["v2", "v3"])
def float_deepseek(request, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp(f"deepseek-{request.param}")
    deepseek_checkpoint(deepseek_config(request.param, **SIZES), folder)
    return folder


@pytest.fixture(scope="module")
def fp8_v3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(DeepSeek-V3's FP8 block form, its dequantized float reference)."""
    root = tmp_path_factory.mktemp("deepseek-v3-fp8")
    deepseek_checkpoint(deepseek_config("v3", **SIZES), root / "float")
    write_fp8_blocks(root / "float", root / "q", root / "ref", BLOCK)
    return root / "q", root / "ref"


def fp8_product(checkpoint: Path, module: str, x: torch.Tensor) -> torch.Tensor:
    """x @ `module`'s e4m3 weights times their block scales, in float64, x rounded to
    e4m3 per group of BLOCK[1] inputs of a row by the group's max|x| / 448."""
    tensors = load_file(str(checkpoint / "model.safetensors"))
    q, scale = tensors[f"{module}.weight"], tensors[f"{module}.weight_scale_inv"]
    w = q.double() * block_scales(scale.double(), q.shape, BLOCK)
    groups = x.double().reshape(x.shape[0], -1, BLOCK[1])
    sx = groups.abs().amax(dim=2, keepdim=True) / 448
    xq = (groups / sx).clamp(-448, 448).to(FP8).double() * sx
    return xq.reshape(x.shape) @ w.t()


def test_v3_fp8_blocks_run_in_e4m3(fp8_v3: tuple[Path, Path]) -> None:
    """Every projection holds only its fp8 panels and multiplies as FP8 does; kv_b_proj
    is the dequantized weight; the outputs are the dequantized model's within what e4m3
    activations cost, and that model's tokens are transformers'."""
    folder, reference = fp8_v3
    llm = LLM(str(folder), **ENGINE)
    model = llm.llm_engine.executor.driver_worker.model_runner.model
    attn = model.layers[1].self_attn
    projections = [attn.q_a_proj, attn.q_proj, attn.kv_a_proj_with_mqa, attn.o_proj]
    assert all(isinstance(p.method, Fp8Method) for p in projections)
    assert all(p.method_state.packed.dtype == FP8 for p in projections)
    assert attn.kv_b_proj is None  # (dequantized into the absorbed products' weights)
    experts = [m for m in model.layers[1].mlp.modules() if isinstance(getattr(m, "method", None),
                                                                    Fp8Method)]  # fmt: skip
    assert len(experts) == 2 * (8 + 1)  # (each expert's gate/up and down, and the shared)
    x = torch.randn(5, attn.q_a_proj.input_size)
    want = fp8_product(folder, "model.layers.1.self_attn.q_a_proj", x)
    torch.testing.assert_close(attn.q_a_proj(x).double(), want, rtol=1e-5, atol=1e-6)
    kv_b = load_file(str(reference / "model.safetensors"))[
        "model.layers.1.self_attn.kv_b_proj.weight"
    ]
    per_head = kv_b.view(4, 32 + 32, 32)
    torch.testing.assert_close(attn.w_uk, per_head[:, :32], rtol=0, atol=1e-7)
    torch.testing.assert_close(attn.w_uv, per_head[:, 32:].transpose(1, 2), rtol=0, atol=1e-7)
    llm.llm_engine.shutdown()
    got, ref = outputs(folder), outputs(reference)
    differences = same_context_differences(got, ref)
    assert len(differences) >= 3 * 5
    assert max(differences) < 0.4 and sum(differences) / len(differences) < 0.1
    assert [tokens for tokens, _ in ref] == transformers_tokens(reference)


@pytest.mark.slow
def test_v3_fp8_over_two_ranks_gives_one_ranks_tokens(fp8_v3: tuple[Path, Path]) -> None:
    """Each rank's row-parallel shard holds whole activation groups, so each rank
    quantizes its inputs as one rank does."""
    layouts = [{"tensor_parallel_size": 2},
               {"tensor_parallel_size": 2, "enable_expert_parallel": True}]  # fmt: skip
    assert_ranks_give_one_ranks_tokens(fp8_v3[0], ENGINE, layouts)


def test_gptq_deepseek_gives_the_dequantized_models_tokens(
    float_deepseek: Path, tmp_path: Path
) -> None:
    """4-bit GPTQ (V2: q_proj whole; V3: through q_lora_rank): the weight-only arithmetic
    is the dequantized weights', so the tokens are transformers' on them."""
    write_quantized(float_deepseek, tmp_path / "q", tmp_path / "ref", "gptq", 4, 32)
    llm = LLM(str(tmp_path / "q"), **ENGINE)
    attn = llm.llm_engine.executor.driver_worker.model_runner.model.layers[2].self_attn
    assert isinstance(attn.q_proj.method, WeightOnlyIntMethod) and attn.kv_b_proj is None
    llm.llm_engine.shutdown()
    tokens = [t for t, _ in outputs(tmp_path / "q")]
    assert tokens == transformers_tokens(tmp_path / "ref")
