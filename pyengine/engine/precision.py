"""The precision a model computes in: `dtype="auto"` resolved on this machine, and the
reason, which the engine logs at start.

On the CPU, "auto" is bfloat16 where the CPU multiplies bfloat16 natively (AMX's tiles or
AVX512-BF16's dot products), as vLLM's CPU backend chooses, float32 checkpoints included:
half the bytes a decode step streams and several times the prefill's products. Elsewhere
it is float32, whose packed-panel kernels are then the fastest. A quantized checkpoint
keeps its quantized form in float32, and so does a KV cache dtype that only float32
weights take on the CPU. A quantized checkpoint's block-quantized layers (GGUF's,
GPTQ/AWQ's) then take their activations as llama.cpp does where the CPU has VNNI: each
row rounded to int8 per block of 32 and multiplied in integers, which brings a 4-bit
decode step to the memory's read bound (the float32 product widens every weight and is
bound by the cores) and nearly doubles a batch's rate. `dtype="float32"` is the exact mode:
greedy tokens identical to transformers in float32, float32 activations everywhere. On
CUDA "auto" is bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyengine import _C
from pyengine.config import QUANTIZED_ACTIVATIONS
from pyengine.layers.quantization.unquantized import split_gemm_enabled

DTYPE_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16",
               "float16": "float16", "half": "float16"}  # fmt: skip


@dataclass(frozen=True)
class Precision:
    """The dtype of the weights and activations, and why it was chosen."""

    dtype: str
    reason: str
    # How block-quantized layers take their activations on the CPU (EngineArgs'
    # quantized_activations, "auto" resolved): "float32" or "int8".
    quantized_activations: str = "float32"


def bf16_unit() -> str | None:
    """The unit that multiplies bfloat16 in pyengine's CPU kernels as they are built and
    pinned now (tests pin narrower builds with _C.set_quantized_dense_isa): "AMX" or
    "AVX512-BF16", or None where bfloat16 would be widened to float32 in registers."""
    if not _C.bf16_dot_product():
        return None
    return "AMX" if _C.amx_tiles() else "AVX512-BF16"


def choose_precision(dtype: str, device: str, quantized: str | None,
                     kv_cache_dtype: str | None = None,
                     quantized_activations: str = "auto") -> Precision:  # fmt: skip
    """`dtype` resolved: "auto" as the module says; a named dtype (also "float", "half")
    as it is. `quantized`: the checkpoint's quantized form (loader.resolve.quantized_form),
    or None for float weights; `kv_cache_dtype`: the cache's dtype asked for, aliases
    resolved (engine_args.cache_dtype_name), or None for the model's;
    `quantized_activations` (EngineArgs'): "auto" keeps the choice made with the dtype
    (int8 only where the dtype is "auto" too), a name replaces it."""
    asked = quantized_activations
    if asked != "auto" and asked not in QUANTIZED_ACTIVATIONS:
        raise ValueError(
            f"quantized_activations {asked!r}: expected one of "
            f"{', '.join(map(repr, ('auto', *QUANTIZED_ACTIVATIONS)))}"
        )
    chosen = _choose_dtype(dtype, device, quantized, kv_cache_dtype, int8=asked == "auto")
    if asked in ("auto", chosen.quantized_activations):
        return chosen
    return Precision(chosen.dtype, f"{chosen.reason}; block forms take {asked} activations "
                                   "(quantized_activations)", asked)  # fmt: skip


def _choose_dtype(dtype: str, device: str, quantized: str | None, kv_cache_dtype: str | None,
                  int8: bool) -> Precision:  # fmt: skip
    """choose_precision's dtype; int8: whether "auto" may pick int8 activations."""
    if dtype != "auto":
        if dtype not in DTYPE_NAMES:
            raise ValueError(
                f"dtype {dtype!r}: expected 'auto', 'float32', 'bfloat16' or 'float16'"
            )
        return Precision(DTYPE_NAMES[dtype], "as asked")
    if device != "cpu":
        return Precision("bfloat16", "auto on a GPU")
    if quantized is not None:
        if int8 and _C.int8_dense_vnni():
            return Precision("float32", f"auto: the checkpoint's {quantized} keep their quantized "
                             "form; its block forms, if any, take activations rounded to int8 "
                             "per 32 for VNNI's products, as llama.cpp does", "int8")  # fmt: skip
        return Precision("float32", f"auto: the checkpoint's {quantized} keep their quantized "
                                    "form, whose CPU kernels take float32 activations")  # fmt: skip
    if kv_cache_dtype not in (None, "bfloat16"):
        return Precision("float32", f"auto: kv_cache_dtype {kv_cache_dtype!r} needs float32 "
                                    "weights on the CPU")  # fmt: skip
    unit = bf16_unit()
    if unit is None:
        return Precision("float32", "auto: this CPU has neither AMX nor AVX512-BF16 (or the "
                                    "kernels are pinned to a build without them)")  # fmt: skip
    return Precision("bfloat16", f"auto: this CPU multiplies bfloat16 on {unit}")


def cpu_kernels(dtype: str) -> str:
    """The matmul kernels a float model's linear layers run on the CPU in `dtype`."""
    isa = _C.quantized_dense_isa()
    if dtype == "bfloat16":
        few = "AVX512-BF16 dot products" if _C.bf16_dot_product() else f"{isa} widened bfloat16"
        many = "AMX tiles" if _C.amx_tiles() else few
        return f"bfloat16 panels: {many} from 8 rows, {few} below"
    if dtype == "float32":
        split = " (split-bfloat16 AMX products from 128 rows)" if split_gemm_enabled() else ""
        return f"float32 panels on {isa}{split}"
    return "torch's matmul"
