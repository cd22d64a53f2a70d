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
from helpers.logprobs import same_context_differences
from helpers.quantized_checkpoints import (
    FP8_GROUP,
    block_scales,
    write_fp8,
    write_quantized,
    write_w4a16,
    write_w8a8,
)
from helpers.tiny_models import make_checkpoint
from safetensors.torch import load_file, save_file

from pyengine import _C, LLM, SamplingParams
from pyengine.layers.linear import LinearBase
from pyengine.layers.quantization.fp8_w8a8 import FP8, Fp8Method
from pyengine.layers.quantization.int8_w8a8 import Int8W8A8Method
from pyengine.layers.quantization.weight_only_int import WeightOnlyIntMethod

pytest.importorskip("transformers")

PROMPTS = [[1, 2, 3, 4, 5, 6], [40, 41, 42], list(range(100, 160))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
# dtype float32: the exact mode, whose tokens are the dequantized weights' to the bit
ENGINE = dict(max_model_len=128, kv_cache_memory=2**22, dtype="float32")
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
    llm = LLM(str(model), **{**ENGINE, **engine_args})
    try:
        result = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in result]
    finally:
        llm.llm_engine.shutdown()


def assert_same_outputs(got: list, want: list) -> None:  # type: ignore[type-arg]
    """The same greedy tokens, and logprobs to float32's rounding of other sums."""
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        for step, ref_step in zip(logprobs, ref_logprobs, strict=True):
            for token, entry in ref_step.items():
                assert abs(step[token].logprob - entry.logprob) < 1e-4


def model_layers(llm: LLM) -> list[tuple[LinearBase, LinearBase]]:
    """Each decoder layer's stacked layers (q/k/v, gate/up)."""
    model = llm.llm_engine.executor.driver_worker.model_runner.model
    return [(layer.self_attn.qkv_proj, layer.mlp.gate_up_proj) for layer in model.layers]


def refuses_quantization(folder: Path, quantization_config: dict, message: str) -> None:  # type: ignore[type-arg]
    """Loading `folder` with this quantization_config in its config.json fails with
    `message`; the config is put back after."""
    config_path = folder / "config.json"
    original = config_path.read_text()
    config = json.loads(original)
    config_path.write_text(json.dumps({**config, "quantization_config": quantization_config}))
    try:
        with pytest.raises(ValueError, match=message):
            LLM(str(folder), **ENGINE)
    finally:
        config_path.write_text(original)


def refuses_weights(folder: Path, tensors: dict, message: str) -> None:  # type: ignore[type-arg]
    """Loading `folder` with these tensors as its weights fails with `message`."""
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), **ENGINE)


@pytest.mark.parametrize("case", list(CASES))
def test_a_quantized_checkpoint_runs_as_its_dequantized_weights(
    float_llama: Path, tmp_path: Path, case: str
) -> None:
    method, bits, group_size, desc_act, shared = CASES[case]
    write_quantized(float_llama, tmp_path / "q", tmp_path / "ref", method, bits, group_size,
                    desc_act, shared_order=shared)  # fmt: skip
    llm = LLM(str(tmp_path / "q"), **ENGINE)
    model = llm.llm_engine.executor.driver_worker.model_runner.model
    linear = [
        m for m in model.modules() if isinstance(getattr(m, "method", None), WeightOnlyIntMethod)
    ]
    assert len(linear) == 2 * 4  # qkv, o, gate_up, down of 2 layers
    assert not any("weight" in m._parameters for m in linear)
    for m in linear:  # one quantized form each
        stacked = m in (m_ for layer in model_layers(llm) for m_ in layer)
        if group_size % 32 == 0 and (shared or not stacked):
            assert m.method_state.packed is not None and m.method_state.qweight is None
            assert (m.method_state.input_order is not None) == desc_act
        else:
            assert m.method_state.packed is None and m.method_state.qweight.dtype == torch.uint8
    llm.llm_engine.shutdown()
    assert_same_outputs(outputs(tmp_path / "q"), outputs(tmp_path / "ref"))


def test_quantized_layers_shard_over_tensor_parallel_ranks(
    float_llama: Path, tmp_path: Path
) -> None:
    write_quantized(float_llama, tmp_path / "q", tmp_path / "ref", "gptq", 4, 32, desc_act=True)
    one = outputs(tmp_path / "q")
    two = outputs(tmp_path / "q", tensor_parallel_size=2)
    assert [t for t, _ in two] == [t for t, _ in one]


@pytest.mark.parametrize("case", ["gptq-4bit-g64-desc-act", "gptq-8bit-g32", "awq-4bit-g32"])
def test_quantized_blocks_take_int8_rows_when_asked(
    float_llama: Path, tmp_path: Path, case: str
) -> None:
    """quantized_activations="int8": a decode step's rows quantized to int8 per block of
    32 for the layers' block forms; each step's logprobs within what 8-bit activations
    cost of the float32 product's, at every step whose tokens so far agree."""
    method, bits, group_size, desc_act, shared = CASES[case]
    write_quantized(float_llama, tmp_path / "q", tmp_path / "ref", method, bits, group_size,
                    desc_act, shared_order=shared)  # fmt: skip
    got = outputs(tmp_path / "q", quantized_activations="int8")
    differences = same_context_differences(got, outputs(tmp_path / "q"))
    assert len(differences) >= 20
    assert max(differences) < 0.3 and sum(differences) / len(differences) < 0.05
    assert max(differences) > 1e-6  # (not the float32 product)


def test_bad_quantized_checkpoints_are_refused_naming_the_problem(
    float_llama: Path, tmp_path: Path
) -> None:
    write_quantized(float_llama, tmp_path / "q", tmp_path / "ref", "gptq", 4, 32)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    for change, message in (
        ({"bits": 3}, "gptq with 3-bit weights is not supported"),
        # The checkpoint's groups of 32 against the config's 64: the first tensor that
        # disagrees is named (a g_idx past the groups, or scales of the wrong shape).
        (
            {"group_size": 64},
            r"weight model\.layers\.\d+\.\S+\.(g_idx: groups outside|scales: shape)",
        ),
        ({"quant_method": "bitsandbytes"}, "quantized checkpoints \\(bitsandbytes\\) are not"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
    ):
        refuses_quantization(tmp_path / "q", {**config["quantization_config"], **change}, message)


def test_a_quantization_asked_for_must_be_the_checkpoints(
    float_llama: Path, tmp_path: Path
) -> None:
    write_quantized(float_llama, tmp_path / "q", tmp_path / "ref", "awq", 4, 32)
    with pytest.raises(ValueError, match="quantization 'gptq' was asked for, and .* is a awq"):
        LLM(str(tmp_path / "q"), quantization="gptq", **ENGINE)
    with pytest.raises(ValueError, match="no quantization_config \\(float weights\\)"):
        LLM(str(tmp_path / "ref"), quantization="awq", **ENGINE)
    LLM(str(tmp_path / "q"), quantization="awq", **ENGINE).llm_engine.shutdown()


def w8a8_reference(checkpoint: Path, module: str, x: torch.Tensor) -> torch.Tensor:
    """x @ the checkpoint's int8 weights of `module` (q/k/v stacked for qkv_proj), as W8A8
    computes it: x quantized per token, the products summed exactly, both scales."""
    tensors = load_file(str(checkpoint / "model.safetensors"))
    parts = ["q_proj", "k_proj", "v_proj"] if module.endswith("qkv_proj") else [module]
    prefix = module.rpartition(".")[0] + "." if module.endswith("qkv_proj") else ""
    q = torch.cat([tensors[f"{prefix}{p}.weight"] for p in parts]).double()
    scale = torch.cat([tensors[f"{prefix}{p}.weight_scale"] for p in parts]).double()
    sx = x.abs().amax(dim=1, keepdim=True).float() / 127
    xq = torch.round(x / sx).clamp(-127, 127).double()
    return (xq @ q.t()) * sx.double() * scale.t()


@pytest.mark.parametrize("isa", [i for i in ("avx512", "avx2", "generic") if _C.cpu_supports(i)])
def test_a_w8a8_checkpoint_runs_in_int8(float_llama: Path, tmp_path: Path, isa: str) -> None:
    """compressed-tensors' int-quantized W8A8: the layers hold only their packed int8
    weights; a layer's product is W8A8's exactly (to float32's rounding); the model's
    logprobs stay within what 8-bit activations cost of the dequantized float model's."""
    write_w8a8(float_llama, tmp_path / "q", tmp_path / "ref")
    _C.set_quantized_dense_isa(isa)
    try:
        llm = LLM(str(tmp_path / "q"), **ENGINE)
        model = llm.llm_engine.executor.driver_worker.model_runner.model
        linear = [
            m for m in model.modules() if isinstance(getattr(m, "method", None), Int8W8A8Method)
        ]
        assert len(linear) == 2 * 4
        assert all(
            m.method_state.packed is not None and "weight" not in m._parameters for m in linear
        )
        # left float (ignore: lm_head)
        assert model.lm_head.method_state.panels.dtype == torch.float32
        layer = model.layers[1].self_attn.qkv_proj
        x = torch.randn(5, layer.input_size)
        want = w8a8_reference(tmp_path / "q", "model.layers.1.self_attn.qkv_proj", x)
        torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-6)
        llm.llm_engine.shutdown()
        got, ref = outputs(tmp_path / "q"), outputs(tmp_path / "ref")
    finally:
        _C.set_quantized_dense_isa("auto")
    assert_close_logprobs(got, ref)
    # In 16 bits (CUDA's placement; here the CPU in bfloat16): int8 x int8 in
    # torch._int_mm where the device has it, the same exact sums.
    llm = LLM(str(tmp_path / "q"), **{**ENGINE, "dtype": "bfloat16"})
    layer = llm.llm_engine.executor.driver_worker.model_runner.model.layers[1].self_attn.qkv_proj
    assert layer.weight.dtype == torch.int8  # not widened
    from pyengine.layers.quantization.int8_w8a8 import int_mm_supported

    assert layer.method_state.int_mm == int_mm_supported(torch.device("cpu"))
    x = torch.randn(5, layer.input_size).bfloat16()
    want = w8a8_reference(tmp_path / "q", "model.layers.1.self_attn.qkv_proj", x.float())
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-2, atol=1e-2)
    llm.llm_engine.shutdown()


def assert_close_logprobs(got: list, ref: list) -> None:  # type: ignore[type-arg]
    """Within what 8-bit integer activations cost: each logprob of the reference's top 5
    by a little, the first tokens the same."""
    differences = [
        abs(step[token].logprob - entry.logprob)
        for (_, logprobs), (_, ref_logprobs) in zip(got, ref, strict=True)
        for step, ref_step in zip(logprobs, ref_logprobs, strict=True)
        for token, entry in ref_step.items()
        if token in step
    ]
    assert max(differences) < 0.3 and sum(differences) / len(differences) < 0.05
    assert [t[:3] for t, _ in got] == [t[:3] for t, _ in ref]


def test_bad_w8a8_checkpoints_are_refused_naming_the_problem(
    float_llama: Path, tmp_path: Path
) -> None:
    write_w8a8(float_llama, tmp_path / "q", tmp_path / "ref")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    scheme = config["quantization_config"]
    group = scheme["config_groups"]["group_0"]
    for change, message in (
        ({"format": "float-quantized"}, "format 'float-quantized' is for float weights"),
        ({"format": "fp4-pack-quantized"}, "format 'fp4-pack-quantized' is not supported"),
        ({"config_groups": {"group_0": {
            **group, "weights": {**group["weights"], "strategy": "tensor"}}}},
         r"weights \{'strategy': 'tensor'\} are not supported"),
        ({"ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, "ignore .* is not supported"),
    ):  # fmt: skip
        refuses_quantization(tmp_path / "q", {**scheme, **change}, message)
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"
    for change, message in (
        ({f"{name}.weight_scale": tensors[f"{name}.weight_scale"][:3]},
         rf"weight {name}.weight_scale: shape \(3, 1\)"),
        ({f"{name}.weight": tensors[f"{name}.weight"].float()},
         rf"weight {name}.weight: torch.float32 values, the model expects torch.int8"),
    ):  # fmt: skip
        refuses_weights(tmp_path / "q", {**tensors, **change}, message)


@pytest.mark.parametrize(
    ("group_size", "actorder"), [(32, None), (-1, None), (32, "group"), (64, "weight")]
)
def test_a_w4a16_checkpoint_runs_as_its_dequantized_weights(
    float_llama: Path, tmp_path: Path, group_size: int, actorder: str | None
) -> None:
    """compressed-tensors' pack-quantized W4A16, packed by its own library (groups in
    activation order too): held as 4-bit blocks, the same weights bit for bit, so the
    same tokens and logprobs."""
    pytest.importorskip("compressed_tensors")
    write_w4a16(float_llama, tmp_path / "q", tmp_path / "ref", group_size, actorder)
    llm = LLM(str(tmp_path / "q"), **ENGINE)
    model = llm.llm_engine.executor.driver_worker.model_runner.model
    linear = [
        m for m in model.modules() if isinstance(getattr(m, "method", None), WeightOnlyIntMethod)
    ]
    assert len(linear) == 2 * 4
    assert all(
        m.method_state.packed is not None and m.method_state.packed.dtype == torch.uint8
        for m in linear
    )
    llm.llm_engine.shutdown()
    assert_same_outputs(outputs(tmp_path / "q"), outputs(tmp_path / "ref"))


def test_bad_w4a16_checkpoints_are_refused_naming_the_problem(
    float_llama: Path, tmp_path: Path
) -> None:
    pytest.importorskip("compressed_tensors")
    write_w4a16(float_llama, tmp_path / "q", tmp_path / "ref", 32)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    scheme = config["quantization_config"]
    weights = scheme["config_groups"]["group_0"]["weights"]
    for change, message in (
        ({"num_bits": 2}, r"weights \{'num_bits': 2\} are not supported"),
        ({"actorder": "dynamic"}, r"weights \{'actorder': 'dynamic'\} are not supported"),
        (
            {"actorder": "group", "strategy": "channel", "group_size": None},
            "orders groups, and strategy 'channel' has none",
        ),
        ({"symmetric": False}, r"weights \{'symmetric': False\} are not supported"),
    ):
        group = {"targets": ["Linear"], "weights": {**weights, **change}}
        refuses_quantization(
            tmp_path / "q", {**scheme, "config_groups": {"group_0": group}}, message
        )
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj"
    refuses_weights(
        tmp_path / "q", {**tensors, f"{name}.weight_shape": torch.tensor([7, 7])},
        rf"weight {name}.weight_shape: \[7, 7\], the model",
    )  # fmt: skip


def test_compressed_tensors_layers_shard_over_tensor_parallel_ranks(
    float_llama: Path, tmp_path: Path
) -> None:
    """W4A16 over two ranks: one rank's tokens. W8A8: each rank of a row-parallel layer
    quantizes its own slice of x (as vLLM's do), so only close to one rank's."""
    pytest.importorskip("compressed_tensors")
    for actorder in (None, "group"):  # (activation order: row-parallel shards dequantize)
        folder = tmp_path / f"w4-{actorder}"
        write_w4a16(float_llama, folder, tmp_path / "ref4", 32, actorder)
        one, two = outputs(folder), outputs(folder, tensor_parallel_size=2)
        assert [t for t, _ in two] == [t for t, _ in one]
    write_w8a8(float_llama, tmp_path / "w8", tmp_path / "ref8")
    one, two = outputs(tmp_path / "w8"), outputs(tmp_path / "w8", tensor_parallel_size=2)
    for (_, logprobs), (_, ref_logprobs) in zip(two, one, strict=True):
        for token, entry in ref_logprobs[0].items():
            assert abs(logprobs[0][token].logprob - entry.logprob) < 0.1


# (weights' scale per, activations' quantization: per token, per tensor (static), none)
FP8_CASES = {
    "channel-dynamic": ("channel", "token"),
    "tensor-static": ("tensor", "tensor"),
    "channel-weight-only": ("channel", None),
    "block-group": ("block", "group"),  # FP8_BLOCK
}


def fp8_reference(
    checkpoint: Path, module: str, x: torch.Tensor, group_activations: bool = False
) -> torch.Tensor:
    """x @ the checkpoint's e4m3 weights of `module` (q/k/v stacked for qkv_proj) in
    float64: x rounded to e4m3 by its row's scale (group_activations: each FP8_GROUP
    inputs' own), or by the parts' largest input_scale."""
    tensors = load_file(str(checkpoint / "model.safetensors"))
    parts = ["q_proj", "k_proj", "v_proj"] if module.endswith("qkv_proj") else [module]
    prefix = module.rpartition(".")[0] + "." if module.endswith("qkv_proj") else ""
    names = [f"{prefix}{p}" for p in parts]
    w = torch.cat([
        tensors[f"{n}.weight"].double()
        * block_scales(tensors[f"{n}.weight_scale"].double(), tensors[f"{n}.weight"].shape)
        for n in names
    ])  # fmt: skip
    if f"{names[0]}.input_scale" in tensors:
        sx = torch.stack([tensors[f"{n}.input_scale"].reshape(()) for n in names]).max()
    elif tensors[f"{names[0]}.weight_scale"].dim() == 2 and group_activations:
        groups = x.reshape(x.shape[0], -1, FP8_GROUP)
        sx = (groups.abs().amax(dim=2, keepdim=True) / 448).expand(groups.shape).reshape(x.shape)
    else:
        sx = x.abs().amax(dim=1, keepdim=True) / 448
    xq = (x / sx).clamp(-448, 448).to(FP8).double() * sx.double()
    return xq @ w.t()


@pytest.mark.parametrize("case", list(FP8_CASES))
def test_an_fp8_checkpoint_runs_in_e4m3(float_llama: Path, tmp_path: Path, case: str) -> None:
    """compressed-tensors' float-quantized FP8, compressed by its own library: the layers
    hold only their fp8 panels; a layer's product is FP8's (to float32's rounding); the
    model's outputs are the dequantized float model's (weight-only: exactly) or within
    what e4m3 activations cost."""
    pytest.importorskip("compressed_tensors")
    strategy, activations = FP8_CASES[case]
    write_fp8(float_llama, tmp_path / "q", tmp_path / "ref", strategy, activations)
    llm = LLM(str(tmp_path / "q"), **ENGINE)
    model = llm.llm_engine.executor.driver_worker.model_runner.model
    linear = [m for m in model.modules() if isinstance(getattr(m, "method", None), Fp8Method)]
    assert len(linear) == 2 * 4
    assert all(m.method_state.packed.dtype == FP8 and "weight" not in m._parameters for m in linear)
    layer = model.layers[1].self_attn.qkv_proj
    x = torch.randn(5, layer.input_size)
    if activations is None:
        want = x.double() @ fp8_reference(tmp_path / "q", "model.layers.1.self_attn.qkv_proj",
                                          torch.eye(layer.input_size))  # fmt: skip
    else:
        want = fp8_reference(
            tmp_path / "q", "model.layers.1.self_attn.qkv_proj", x, activations == "group"
        )
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-6)
    llm.llm_engine.shutdown()
    got, ref = outputs(tmp_path / "q"), outputs(tmp_path / "ref")
    if activations is None:
        assert_same_outputs(got, ref)
    else:  # e4m3's 3 mantissa bits cost more than int8 per token does
        differences = same_context_differences(got, ref)
        assert len(differences) >= 3 * 5
        assert max(differences) < 0.4 and sum(differences) / len(differences) < 0.1
    if activations is not None:  # and each rank of a row-parallel layer quantizes its x
        differences = same_context_differences(outputs(tmp_path / "q", tensor_parallel_size=2), got)
        assert max(differences) < 0.4 and sum(differences) / len(differences) < 0.1


def test_fp8_in_16_bits_multiplies_through_scaled_mm(float_llama: Path, tmp_path: Path) -> None:
    """A 16-bit FP8 model (CUDA's placement; here the CPU in bfloat16) multiplies e4m3 by
    e4m3 in torch._scaled_mm, scales per token and channel: FP8's product to bfloat16's
    rounding, and close to the float32 FP8 model's outputs."""
    pytest.importorskip("compressed_tensors")
    from pyengine.layers.quantization.fp8_w8a8 import scaled_mm_supported

    if not scaled_mm_supported(torch.device("cpu"), torch.bfloat16):
        pytest.skip("this torch has no CPU torch._scaled_mm")
    write_fp8(float_llama, tmp_path / "q", tmp_path / "ref", "channel", "token")
    llm = LLM(str(tmp_path / "q"), **{**ENGINE, "dtype": "bfloat16"})
    model = llm.llm_engine.executor.driver_worker.model_runner.model
    layer = model.layers[1].self_attn.qkv_proj
    assert isinstance(layer.method, Fp8Method) and layer.method_state.scaled_mm
    assert layer.weight.dtype == FP8 and layer.method_state.packed is None
    x = torch.randn(5, layer.input_size).bfloat16()
    want = fp8_reference(tmp_path / "q", "model.layers.1.self_attn.qkv_proj", x.float())
    torch.testing.assert_close(layer(x).double(), want, rtol=2e-2, atol=2e-2)
    llm.llm_engine.shutdown()
    got = outputs(tmp_path / "q", dtype="bfloat16")
    differences = same_context_differences(got, outputs(tmp_path / "q"))
    assert max(differences) < 0.5 and sum(differences) / len(differences) < 0.15


def test_bad_fp8_checkpoints_are_refused_naming_the_problem(
    float_llama: Path, tmp_path: Path
) -> None:
    pytest.importorskip("compressed_tensors")
    write_fp8(float_llama, tmp_path / "q", tmp_path / "ref", "tensor", "tensor")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    scheme = config["quantization_config"]
    group = scheme["config_groups"]["group_0"]
    inputs = group["input_activations"]
    for change, message in (
        ({"weights": {**group["weights"], "strategy": "group"}},
         r"weights \{'strategy': 'group'\} are not supported"),
        ({"weights": {**group["weights"], "strategy": "block"}},
         r"block weights need a block_structure \[out, in\], got None"),
        ({"weights": {**group["weights"], "strategy": "block", "block_structure": [0, 128]}},
         r"block_structure must be two positive sizes"),
        ({"input_activations": {**inputs, "strategy": "group", "dynamic": True}},
         "group activations need a group_size, got None"),
        ({"input_activations": {**inputs, "dynamic": True}},
         "FP8 activations are dynamic per token or group, or static per tensor"),
        ({"input_activations": {**inputs, "num_bits": 4}},
         r"input_activations \{'num_bits': 4\} are not supported"),
    ):  # fmt: skip
        changed = {**scheme, "config_groups": {"group_0": {**group, **change}}}
        refuses_quantization(tmp_path / "q", changed, message)
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"
    nan_weight = tensors[f"{name}.weight"].clone()
    nan_weight.view(torch.uint8)[2, 5] = 0x7F
    without_input_scale = {k: v for k, v in tensors.items() if k != f"{name}.input_scale"}
    for weights, message in (
        ({**tensors, f"{name}.weight_scale": torch.ones(3)}, rf"weight {name}.weight_scale"),
        ({**tensors, f"{name}.weight_scale": torch.zeros(1)}, "scales must be finite and positive"),
        ({**tensors, f"{name}.weight": tensors[f"{name}.weight"].float()},
         rf"weight {name}.weight: torch.float32 values, the model expects torch.float8_e4m3fn"),
        ({**tensors, f"{name}.weight": nan_weight}, "holds NaN"),
        (without_input_scale, rf"lacks 1 weights, e.g. \['{name}.input_scale'\]"),
    ):  # fmt: skip
        refuses_weights(tmp_path / "q", weights, message)
    # fp8 tensors outside a quantized checkpoint mean nothing without their scales
    reference = load_file(str(tmp_path / "ref" / "model.safetensors"))
    weight = "model.layers.0.self_attn.o_proj.weight"
    refuses_weights(
        tmp_path / "ref", {**reference, weight: reference[weight].to(FP8)},
        rf"tensor {weight} is F8_E4M3: fp8 weights come",
    )  # fmt: skip


def test_an_int8_kv_cache_takes_a_checkpoints_static_scales(
    float_llama: Path, tmp_path: Path
) -> None:
    """compressed-tensors' int8 kv_cache_scheme: with kv_cache_dtype="int8" each layer's
    K and V are written by its k_scale and v_scale (the scale beside every token is the
    checkpoint's), and the model stays close to its float cache; a float cache needs no
    scales; what the scheme cannot be is refused."""
    write_w8a8(float_llama, tmp_path / "q", tmp_path / "ref", kv_scales=(0.03, 0.02))
    llm = LLM(str(tmp_path / "q"), kv_cache_dtype="int8", **ENGINE)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    attn = runner.model.layers[1].self_attn.attn
    assert (attn.k_scale, attn.v_scale) == pytest.approx((0.033, 0.022))
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    key_cache, value_cache = runner.caches[1]
    d = runner.model.config.head_size
    k_scales = key_cache[:, :, d:, :].reshape(key_cache.shape[0], key_cache.shape[1], -1)
    v_scales = value_cache[:, :, :, d:].contiguous()
    written_k = k_scales.view(torch.float32).flatten()
    written_v = v_scales.view(torch.float32).flatten()
    for written, want in ((written_k, attn.k_scale), (written_v, attn.v_scale)):
        slots = written[written != 0]  # every token's, in each kv head, none other
        tokens = sum(map(len, PROMPTS)) + (GREEDY.max_tokens - 1) * len(PROMPTS)
        assert len(slots) == tokens * runner.num_kv_heads
        assert bool((slots == want).all())
    llm.llm_engine.shutdown()
    full = outputs(tmp_path / "q")  # a float32 cache: the scales go unused
    differences = same_context_differences(
        [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in got], full
    )
    assert max(differences) < 0.3 and sum(differences) / len(differences) < 0.05
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    scheme = config["quantization_config"]
    for change, message in (
        ({"num_bits": 4}, r"kv_cache_scheme \{'num_bits': 4\} are not supported"),
        ({"strategy": "head"}, r"kv_cache_scheme \{'strategy': 'head'\} are not supported"),
    ):
        kv = {**scheme["kv_cache_scheme"], **change}
        refuses_quantization(tmp_path / "q", {**scheme, "kv_cache_scheme": kv}, message)
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    name = "model.layers.0.self_attn.k_scale"
    for weights, message in (
        ({k: v for k, v in tensors.items() if k != name}, rf"lacks 1 weights, e.g. \['{name}'\]"),
        ({**tensors, name: torch.tensor([-1.0])}, "k_scale and v_scale must be finite and posi"),
        ({**tensors, name: torch.ones(2)}, rf"weight {name}: shape \(2,\), one value expected"),
    ):  # fmt: skip
        refuses_weights(tmp_path / "q", weights, message)


def test_an_fp8_kv_cache_takes_a_checkpoints_static_scales(
    float_llama: Path, tmp_path: Path
) -> None:
    """compressed-tensors' fp8 kv_cache_scheme: with kv_cache_dtype="fp8" each layer's K
    and V are stored as e4m3(x / k_scale), e4m3(x / v_scale) (vLLM's fp8 cache with a
    checkpoint's scales), the scores taken times k_scale and the output times v_scale;
    the model stays close to its float cache. A float cache leaves the scales unused."""
    k_scale, v_scale = 0.01, 0.008
    write_w8a8(float_llama, tmp_path / "q", tmp_path / "ref", (k_scale, v_scale), "float")
    caches = []
    for folder in ("q", "ref"):  # (the reference: the same weights, no scales)
        llm = LLM(str(tmp_path / folder), kv_cache_dtype="fp8", **ENGINE)
        runner = llm.llm_engine.executor.driver_worker.model_runner
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)  # the prompts' K/V
        caches.append([c.view(torch.float8_e4m3fn).float() for c in runner.caches[0]])
        if folder == "q":
            got = llm.generate(prompts, GREEDY, use_tqdm=False)
            attn = runner.model.layers[0].self_attn.attn
            assert attn.scaled_cache == torch.uint8
            assert (attn.k_scale, attn.v_scale) == pytest.approx((k_scale, v_scale))
            scaled = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in got]
        llm.llm_engine.shutdown()
    # Layer 0's K and V of the prompts are nearly the same in both runs (its inputs are the
    # embeddings; int8 activations here): stored divided by the scales here, as themselves
    # there, each to e4m3's 3 bits.
    for stored, plain, scale in zip(caches[0], caches[1], (k_scale, v_scale), strict=True):
        assert stored.abs().max() > 20 * plain.abs().max()  # (the scaled range, not x's)
        torch.testing.assert_close(stored * scale, plain, rtol=0.13, atol=0.05)
    differences = same_context_differences(scaled, outputs(tmp_path / "q"))
    assert max(differences) < 0.3 and sum(differences) / len(differences) < 0.05


def test_fp8_block_weights_in_16_bits_are_dequantized_each_step(
    float_llama: Path, tmp_path: Path
) -> None:
    """FP8_BLOCK on a 16-bit placement (no _scaled_mm for block scales): the e4m3 weight
    kept, each weight's block scale applied as a step runs; x quantized per group."""
    pytest.importorskip("compressed_tensors")
    write_fp8(float_llama, tmp_path / "q", tmp_path / "ref", "block", "group")
    llm = LLM(str(tmp_path / "q"), **{**ENGINE, "dtype": "bfloat16"})
    layer = llm.llm_engine.executor.driver_worker.model_runner.model.layers[1].self_attn.qkv_proj
    assert layer.weight.dtype == FP8 and not layer.method_state.scaled_mm
    assert layer.method_state.weight_scale.shape == layer.weight.shape  # (a scale a weight)
    x = torch.randn(5, layer.input_size).bfloat16()
    want = fp8_reference(tmp_path / "q", "model.layers.1.self_attn.qkv_proj", x.float(), True)
    torch.testing.assert_close(layer(x).double(), want, rtol=2e-2, atol=2e-2)
    llm.llm_engine.shutdown()
