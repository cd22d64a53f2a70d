"""Quantized mixture-of-experts checkpoints (GPTQ, AWQ, compressed-tensors W4A16, W8A8
and FP8), written in the test from tiny random checkpoints that transformers makes
(helpers/quantized_checkpoints.py quantizes every expert's projections, and a shared
expert's): greedy float32 tokens identical to transformers' on the dequantized weights
where the arithmetic is the float weights' (the experts stacked as blocks for the fused
kernel, or looped over where their inputs are reordered or their integers kept), and
within what 8-bit activations cost where they are quantized; over two ranks, with and
without expert parallelism, the one rank's tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.hf_reference import hf_greedy
from helpers.quantized_checkpoints import write_fp8, write_quantized, write_w4a16, write_w8a8
from helpers.tiny_moe import moe_checkpoint
from safetensors.torch import load_file, save_file

from pyengine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

ENGINE = dict(max_model_len=128, kv_cache_memory=2**22, dtype="float32")
# Sizes of whole blocks of 32 (and of 32 per rank over two), which the fused kernel's
# block form takes.
SIZES = {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}
PROMPT_LENGTHS = (5, 40)
NEW_TOKENS = 10


def write(case: str, float_folder: Path, out: Path, reference: Path) -> None:
    """`out`: float_folder's checkpoint quantized as `case` names; `reference`: its
    dequantized float32 weights."""
    kind, _, detail = case.partition("-")
    if kind in ("gptq", "awq"):
        bits, group, *order = detail.split("-")
        size = int(group.removeprefix("g"))
        write_quantized(float_folder, out, reference, kind, int(bits.removesuffix("bit")),
                        size, desc_act=order == ["desc", "act"])  # fmt: skip
    elif kind == "w4a16":
        write_w4a16(float_folder, out, reference, int(detail.removeprefix("g")))
    elif kind == "w8a8":
        write_w8a8(float_folder, out, reference)
    else:  # fp8-<activations>
        write_fp8(float_folder, out, reference, "channel", None if detail == "float" else detail)


# case -> the experts' form: stacked for the fused kernel, or linear layers looped over.
EXACT = {
    "gptq-4bit-g32": "4-bit blocks experts",
    "gptq-8bit-g32": "8-bit blocks experts",
    "awq-4bit-g32": "4-bit blocks experts",
    "w4a16-g32": "4-bit blocks experts",
    "fp8-float": "fp8 blocks experts",
    # (each expert's inputs in an order of its own: its rows reordered, an expert a time)
    "gptq-4bit-g32-desc-act": "experts as linear layers",
    # (groups inside a block: the integers kept, dequantized each step)
    "gptq-4bit-g16": "experts as linear layers",
}
# Rows quantized to 8 bits per token before each product: an expert at a time.
APPROXIMATE = ("w8a8", "fp8-token")


@pytest.fixture(scope="module")
def float_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2_moe")  # (a gated shared expert too)
    moe_checkpoint("qwen2_moe", folder, **SIZES)
    return folder


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, 256, n).tolist() for n in PROMPT_LENGTHS]


def generate(folder: Path, **engine_args: object) -> tuple[list[list[int]], list, LLM]:  # type: ignore[type-arg]
    """Greedy tokens and their top-5 logprobs for prompts(), and the engine."""
    llm = LLM(str(folder), **{**ENGINE, **engine_args})
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].logprobs for o in outs], llm


def expert_forms(llm: LLM) -> list[str | None]:
    model = llm.llm_engine.executor.driver_worker.model_runner.model
    return [layer.mlp.weight_form() for layer in model.layers if hasattr(layer.mlp, "routing")]


def transformers_tokens(reference: Path) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    return [hf_greedy(model, p, NEW_TOKENS) for p in prompts()]


@pytest.mark.parametrize("case", list(EXACT))
def test_quantized_experts_give_the_dequantized_models_tokens(
    float_moe: Path, tmp_path: Path, case: str
) -> None:
    write(case, float_moe, tmp_path / "q", tmp_path / "ref")
    tokens, _, llm = generate(tmp_path / "q")
    assert expert_forms(llm) == [EXACT[case]] * 2
    mlp = llm.llm_engine.executor.driver_worker.model_runner.model.layers[1].mlp
    if EXACT[case] != "experts as linear layers":  # (stacked: no linear layers left)
        assert mlp.experts is None
    llm.llm_engine.shutdown()
    assert tokens == transformers_tokens(tmp_path / "ref")


def assert_close(tokens: list, logprobs: list, ref_tokens: list, ref_logprobs: list) -> None:  # type: ignore[type-arg]
    """Top-5 logprobs within what 8-bit activations cost (e4m3's 3 mantissa bits more
    than int8's), at each step whose context is the same (up to the first token that
    differs: the tiny model's top logprobs lie within 0.01 of each other, so no token is
    asserted)."""
    differences = [
        abs(step[token].logprob - entry.logprob)
        for t, r, got, want in zip(tokens, ref_tokens, logprobs, ref_logprobs, strict=True)
        for i, (step, ref_step) in enumerate(zip(got, want, strict=True))
        if t[:i] == r[:i]
        for token, entry in ref_step.items()
        if token in step
    ]
    assert len(differences) >= 2 * 3 * 5
    assert max(differences) < 0.4 and np.mean(differences) < 0.1


@pytest.mark.parametrize("case", APPROXIMATE)
def test_quantized_activations_stay_close_to_the_dequantized_model(
    float_moe: Path, tmp_path: Path, case: str
) -> None:
    write(case, float_moe, tmp_path / "q", tmp_path / "ref")
    tokens, logprobs, llm = generate(tmp_path / "q")
    assert expert_forms(llm) == ["experts as linear layers"] * 2
    llm.llm_engine.shutdown()
    ref_tokens, ref_logprobs, llm = generate(tmp_path / "ref")
    llm.llm_engine.shutdown()
    assert_close(tokens, logprobs, ref_tokens, ref_logprobs)
    assert ref_tokens == transformers_tokens(tmp_path / "ref")


def test_stacked_blocks_take_int8_rows_when_asked(float_moe: Path, tmp_path: Path) -> None:
    write("gptq-4bit-g32", float_moe, tmp_path / "q", tmp_path / "ref")
    tokens, _, llm = generate(tmp_path / "q", quantized_activations="int8")
    mlp = llm.llm_engine.executor.driver_worker.model_runner.model.layers[1].mlp
    assert mlp.method.int8_activations and mlp.weight_form() == "4-bit blocks experts"
    llm.llm_engine.shutdown()
    expected = transformers_tokens(tmp_path / "ref")
    pairs = [pair for t, e in zip(tokens, expected, strict=True) for pair in zip(t, e, strict=True)]
    same = sum(a == b for a, b in pairs)
    assert same >= 0.8 * sum(map(len, expected))


def over_two_ranks(folder: Path) -> Iterator[tuple[list, list, list, list]]:  # type: ignore[type-arg]
    """(tokens, logprobs) at one rank, then at two with and without expert parallelism."""
    expected, expected_logprobs, llm = generate(folder)
    llm.llm_engine.shutdown()
    for expert_parallel in (False, True):
        got, logprobs, llm = generate(folder, tensor_parallel_size=2,
                                      enable_expert_parallel=expert_parallel)  # fmt: skip
        llm.llm_engine.shutdown()
        yield got, logprobs, expected, expected_logprobs


def test_two_ranks_give_one_ranks_tokens(float_moe: Path, tmp_path: Path) -> None:
    """Each expert's layers sharded as a dense MLP's (64 into 32s), or whole experts on
    each rank (4 of 8): the one rank's tokens."""
    write("gptq-4bit-g32", float_moe, tmp_path / "q", tmp_path / "ref")
    for got, _, expected, _ in over_two_ranks(tmp_path / "q"):
        assert got == expected


@pytest.mark.slow
def test_two_ranks_of_int8_activations_stay_close(float_moe: Path, tmp_path: Path) -> None:
    """W8A8 over two ranks: each rank quantizes the rows of its shard of a row-parallel
    layer (as vLLM's do), so the product is close to one rank's, not equal."""
    write("w8a8", float_moe, tmp_path / "q", tmp_path / "ref")
    for got, logprobs, expected, expected_logprobs in over_two_ranks(tmp_path / "q"):
        assert_close(got, logprobs, expected, expected_logprobs)


def test_mixtral_experts_named_w1_w2_w3(tmp_path: Path) -> None:
    moe_checkpoint("mixtral", tmp_path / "f", intermediate_size=64)
    write("awq-4bit-g32", tmp_path / "f", tmp_path / "q", tmp_path / "ref")
    tokens, _, llm = generate(tmp_path / "q")
    assert expert_forms(llm) == ["4-bit blocks experts"] * 3
    llm.llm_engine.shutdown()
    assert tokens == transformers_tokens(tmp_path / "ref")


def test_a_missing_experts_integers_are_named(float_moe: Path, tmp_path: Path) -> None:
    write("gptq-4bit-g32", float_moe, tmp_path / "q", tmp_path / "ref")
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    missing = "model.layers.1.mlp.experts.5.down_proj.qzeros"
    del tensors[missing]
    save_file(tensors, str(tmp_path / "q" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"the checkpoint lacks 1 weights, e.g. \\['{missing}'"):
        LLM(str(tmp_path / "q"), **ENGINE)
