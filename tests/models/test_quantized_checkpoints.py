"""GPTQ (4- and 8-bit, activation order too) and AWQ checkpoints, written in the test by
the documented layouts: held in quantized form only (no float weight; blocks of 32 inputs
where the groups allow, activation order sorted into them, else the integers, dequantized
each step), their logits those of the model with the dequantized float weights, and the
same greedy tokens; sharded over tensor-parallel ranks, the same tokens as one rank; bad
ones refused, named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.quantized_checkpoints import write_quantized
from helpers.tiny_models import make_checkpoint

from pyengine import LLM, SamplingParams
from pyengine.layers.linear import LinearBase
from pyengine.layers.weight_only_int import WeightOnlyIntMethod

pytest.importorskip("transformers")

PROMPTS = [[1, 2, 3, 4, 5, 6], [40, 41, 42], list(range(100, 160))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
ENGINE = dict(max_model_len=128, kv_cache_memory=2**22)
# (method, bits, group size, activation order, shared by the weights of one input)
CASES = {
    "gptq-4bit-g32": ("gptq", 4, 32, False, True),
    "gptq-4bit-g64-desc-act": ("gptq", 4, 64, True, True),
    "gptq-8bit-g32": ("gptq", 8, 32, False, True),
    "awq-4bit-g32": ("awq", 4, 32, False, True),
    # Integers kept: groups inside a block; q/k/v (gate/up) each in an order of its own.
    "gptq-4bit-g16": ("gptq", 4, 16, False, True),
    "gptq-4bit-g32-own-orders": ("gptq", 4, 32, True, False),
}


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    make_checkpoint("llama", folder)
    return folder


def outputs(model: Path, **engine_args: object) -> list:  # type: ignore[type-arg]
    llm = LLM(str(model), **ENGINE, **engine_args)
    try:
        result = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in result]
    finally:
        llm.engine.shutdown()


def model_layers(llm: LLM) -> list[tuple[LinearBase, LinearBase]]:
    """Each decoder layer's stacked layers (q/k/v, gate/up)."""
    model = llm.engine.executor.driver_worker.model_runner.model
    return [(layer.self_attn.qkv_proj, layer.mlp.gate_up_proj) for layer in model.layers]


@pytest.mark.parametrize("case", list(CASES))
def test_a_quantized_checkpoint_runs_as_its_dequantized_weights(
    float_llama: Path, tmp_path: Path, case: str
) -> None:
    method, bits, group_size, desc_act, shared = CASES[case]
    write_quantized(float_llama, tmp_path / "q", tmp_path / "ref", method, bits, group_size,
                    desc_act, shared_order=shared)  # fmt: skip
    llm = LLM(str(tmp_path / "q"), **ENGINE)
    model = llm.engine.executor.driver_worker.model_runner.model
    linear = [
        m for m in model.modules() if isinstance(getattr(m, "method", None), WeightOnlyIntMethod)
    ]
    assert len(linear) == 2 * 4  # qkv, o, gate_up, down of 2 layers
    assert not any("weight" in m._parameters for m in linear)
    for m in linear:  # one quantized form each
        stacked = m in (m_ for layer in model_layers(llm) for m_ in layer)
        if group_size % 32 == 0 and (shared or not stacked):
            assert m.packed_blocks is not None and not hasattr(m, "qweight")
            assert (m.input_order is not None) == desc_act
        else:
            assert m.packed_blocks is None and m.qweight.dtype == torch.uint8
    llm.engine.shutdown()
    got, want = outputs(tmp_path / "q"), outputs(tmp_path / "ref")
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        for step, ref_step in zip(logprobs, ref_logprobs, strict=True):
            for token, entry in ref_step.items():
                assert abs(step[token].logprob - entry.logprob) < 1e-4


def test_quantized_layers_shard_over_tensor_parallel_ranks(
    float_llama: Path, tmp_path: Path
) -> None:
    write_quantized(float_llama, tmp_path / "q", tmp_path / "ref", "gptq", 4, 32, desc_act=True)
    one = outputs(tmp_path / "q")
    two = outputs(tmp_path / "q", tensor_parallel_size=2)
    assert [t for t, _ in two] == [t for t, _ in one]


def test_bad_quantized_checkpoints_are_refused_naming_the_problem(
    float_llama: Path, tmp_path: Path
) -> None:
    write_quantized(float_llama, tmp_path / "q", tmp_path / "ref", "gptq", 4, 32)
    config_path = tmp_path / "q" / "config.json"
    config = json.loads(config_path.read_text())
    for change, message in (
        ({"bits": 3}, "gptq with 3-bit weights is not supported"),
        # The checkpoint's groups of 32 against the config's 64: the first tensor that
        # disagrees is named (a g_idx past the groups, or scales of the wrong shape).
        (
            {"group_size": 64},
            r"weight model\.layers\.\d+\.\S+\.(g_idx: groups outside|scales: shape)",
        ),
        ({"quant_method": "fp8"}, "quantized checkpoints \\(fp8\\) are not supported"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
    ):
        config_path.write_text(json.dumps({**config, "quantization_config": {
            **config["quantization_config"], **change}}))  # fmt: skip
        with pytest.raises(ValueError, match=message):
            LLM(str(tmp_path / "q"), **ENGINE)


def test_a_quantization_asked_for_must_be_the_checkpoints(
    float_llama: Path, tmp_path: Path
) -> None:
    write_quantized(float_llama, tmp_path / "q", tmp_path / "ref", "awq", 4, 32)
    with pytest.raises(ValueError, match="quantization 'gptq' was asked for, and .* is a awq"):
        LLM(str(tmp_path / "q"), quantization="gptq", **ENGINE)
    with pytest.raises(ValueError, match="no quantization_config \\(float weights\\)"):
        LLM(str(tmp_path / "ref"), quantization="awq", **ENGINE)
    LLM(str(tmp_path / "q"), quantization="awq", **ENGINE).engine.shutdown()
