"""dtype="auto": bfloat16 where the CPU multiplies it natively, float32 elsewhere, for
quantized checkpoints and for the KV cache dtypes only float32 weights take; a quantized
checkpoint's blocks take int8 activations where the CPU has VNNI; the log line that says
so; and one copy of the weights resident in the chosen form."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.dense_isa import AMX, TILE_ISAS, pin_dense_isa, unpin_dense_isa
from helpers.tiny_models import TINY_LLAMA

from pyengine import _C, LLM
from pyengine.engine.precision import bf16_unit, choose_precision

BF16_DOT = _C.cpu_supports("avx512") and _C.bf16_dot_product()
VNNI = "avx512_vnni" in Path("/proc/cpuinfo").read_text().split()


@pytest.fixture(params=TILE_ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    pin_dense_isa(request.param)
    yield request.param
    unpin_dense_isa()


def test_auto_on_each_instruction_set(isa: str) -> None:
    """AMX (its tiles) and AVX512-BF16 (its dot products) multiply bfloat16: auto picks it;
    a build without them (AVX2, generic) widens bfloat16 in registers: float32."""
    expected_unit = {"amx": "AMX", "avx512": "AVX512-BF16" if BF16_DOT else None}.get(isa)
    assert bf16_unit() == expected_unit
    chosen = choose_precision("auto", "cpu", None)
    assert chosen.dtype == ("bfloat16" if expected_unit else "float32")
    assert (expected_unit or "neither AMX nor AVX512-BF16") in chosen.reason


def test_auto_keeps_quantized_forms_and_float32_only_caches(isa: str) -> None:
    assert choose_precision("auto", "cpu", "GGUF blocks").dtype == "float32"
    assert choose_precision("auto", "cpu", "gptq").dtype == "float32"
    for cache in ("int8", "fp8", "float16", "float32"):
        chosen = choose_precision("auto", "cpu", None, cache)
        assert chosen.dtype == "float32" and cache in chosen.reason
    # a bfloat16 cache goes with bfloat16 weights wherever auto picks them
    assert choose_precision("auto", "cpu", None, "bfloat16") == choose_precision(
        "auto", "cpu", None
    )


def test_auto_takes_int8_activations_for_blocks_where_vnni_multiplies_them(isa: str) -> None:
    """VNNI's int8 products (the AVX-512 build and AMX's, on a CPU with VNNI) make int8
    activations the faster arithmetic for block-quantized layers; elsewhere, and in the
    exact mode, they stay float32."""
    expected = "int8" if VNNI and isa in ("avx512", "amx") else "float32"
    for form in ("GGUF blocks", "gptq", "awq", "compressed-tensors"):
        chosen = choose_precision("auto", "cpu", form)
        assert chosen.dtype == "float32" and chosen.quantized_activations == expected
        assert ("int8 per 32" in chosen.reason) == (expected == "int8")
    assert choose_precision("float32", "cpu", "GGUF blocks").quantized_activations == "float32"
    assert choose_precision("auto", "cpu", None).quantized_activations == "float32"


def test_quantized_activations_asked_for_replace_the_choice() -> None:
    def chosen(dtype: str, activations: str):  # type: ignore[no-untyped-def]
        return choose_precision(dtype, "cpu", "GGUF blocks", None, activations)

    auto = choose_precision("auto", "cpu", "GGUF blocks")
    assert chosen("auto", "auto") == auto
    assert chosen("auto", "float32").quantized_activations == "float32"
    asked = chosen("float32", "int8")
    assert asked.quantized_activations == "int8"
    assert asked.reason == "as asked; block forms take int8 activations (quantized_activations)"
    replaced = chosen("auto", "float32").reason
    assert "take float32 activations" in replaced and "int8" not in replaced
    with pytest.raises(ValueError, match="quantized_activations 'int4': expected one of"):
        chosen("auto", "int4")


def test_named_dtypes_are_kept_and_bad_ones_refused() -> None:
    assert choose_precision("float32", "cpu", None).dtype == "float32"
    assert choose_precision("half", "cpu", None).dtype == "float16"
    assert choose_precision("bfloat16", "cpu", "GGUF blocks").dtype == "bfloat16"
    assert choose_precision("auto", "cuda", None).dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype 'float64': expected 'auto'"):
        choose_precision("float64", "cpu", None)


def test_the_engine_computes_in_the_chosen_dtype_and_logs_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    with caplog.at_level(logging.INFO, logger="pyengine"):
        llm = LLM(str(tmp_path), load_format="dummy", max_model_len=64, kv_cache_memory=2**22)
    expected = "bfloat16" if bf16_unit() else "float32"
    engine = llm.llm_engine
    assert engine.config.dtype == expected and engine.config.cache_dtype == expected
    lines = [r.getMessage() for r in caplog.records]
    precision = next(line for line in lines if line.startswith("precision: "))
    assert precision.startswith(f"precision: {expected} (auto: ") and "matmuls: " in precision
    weights = next(line for line in lines if line.startswith("weights: "))
    runner = engine.executor.driver_worker.model_runner
    assert weights.startswith(f"weights: {expected}, {runner.weight_bytes / 2**20:.1f} MiB")
    assert any(line.startswith("engine ready in ") for line in lines)
    engine.shutdown()


def test_the_default_model_keeps_its_4_bit_blocks(caplog: pytest.LogCaptureFixture) -> None:
    from pyengine.loader.resolve import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    with caplog.at_level(logging.INFO, logger="pyengine"):
        llm = LLM(max_model_len=64, kv_cache_memory=2**22)
    config = llm.llm_engine.config
    assert config.dtype == "float32"
    assert config.quantized_activations == ("int8" if _C.int8_dense_vnni() else "float32")
    assert any("GGUF blocks keep their quantized form" in r.getMessage() for r in caplog.records)
    llm.llm_engine.shutdown()


# Loads a float32 checkpoint in bfloat16 in a process of its own and prints its resident
# bytes before and after, and the weight bytes the engine counts.
RESIDENT = """
import gc, json, sys
from pyengine import LLM
from pyengine.utils import host_memory

def resident():
    gc.collect()
    host_memory.release_free_heap()
    with open("/proc/self/status") as status:
        return next(int(x.split()[1]) * 1024 for x in status if x.startswith("VmRSS:"))

before = resident()
llm = LLM(sys.argv[1], dtype="bfloat16", max_model_len=64, kv_cache_memory=2**20,
          enforce_eager=True)
after = resident()
runner = llm.llm_engine.executor.driver_worker.model_runner
print(json.dumps({"grown": after - before, "weights": runner.weight_bytes}))
"""


@pytest.mark.skipif(not AMX and not BF16_DOT, reason="bfloat16 on the CPU needs AVX512-BF16")
def test_a_float32_checkpoint_in_bfloat16_holds_one_bfloat16_copy(tmp_path: Path) -> None:
    """126 MB of float32 weights load as 63 MB of bfloat16 panels, and the process grows
    by about that: no float32 copy of the checkpoint is left beside them."""
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(tmp_path)
    params = sum(p.numel() for p in model.parameters())
    del model
    out = subprocess.run(
        [sys.executable, "-c", RESIDENT, str(tmp_path)], capture_output=True, text=True,
        timeout=300, cwd=tempfile.gettempdir(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    # the panels pad each matrix's columns to whole panels of 48: a little over 2 bytes
    assert 2 * params <= figures["weights"] < 2.1 * params
    # a float32 copy beside them would add 4 bytes a weight
    assert figures["grown"] < figures["weights"] + 1.0 * params, figures
