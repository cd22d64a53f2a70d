"""GPTQ, AWQ and compressed-tensors W8A8 checkpoints written in the test, by the
documented tensor layouts (an implementation of its own, independent of pyengine's
reader): a float checkpoint's linear weights quantized (GPTQ/AWQ per group, min/max,
asymmetric, packed into int32; W8A8 per output channel, symmetric int8), with the
dequantized float weights of the same values for the reference checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

# (Mixtral's experts: w1 the gate, w3 the up and w2 the down projection; DeepSeek's
# latent attention's projections)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
          "w1", "w2", "w3", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # fmt: skip
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an int32 holds column order[k]


def _to_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy((words & 0xFFFFFFFF).astype(np.uint32).view(np.int32))


def quantize(w: np.ndarray, bits: int, group_of: np.ndarray, groups: int):  # type: ignore[no-untyped-def]
    """w [out, in] -> (q [out, in], scales [groups, out] as float16, zeros [groups, out],
    dequantized [out, in]); zero points in [1, 2^bits - 1] (GPTQ's stored zero less 1
    must not wrap)."""
    top = (1 << bits) - 1
    out = w.shape[0]
    scales = np.zeros((groups, out))
    zeros = np.zeros((groups, out), dtype=np.int64)
    for g in range(groups):
        cols = w[:, group_of == g]
        low, high = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
        scales[g] = np.maximum(high - low, 1e-8) / (top - 1)
        zeros[g] = np.clip(np.round(-low / scales[g]) + 1, 1, top)
    scales = scales.astype(np.float16).astype(np.float64)  # stored as float16
    q = np.clip(np.round(w / scales[group_of].T) + zeros[group_of].T, 0, top).astype(np.int64)
    deq = (q - zeros[group_of].T) * scales[group_of].T
    return q, scales.astype(np.float16), zeros, deq


def pack_gptq(q: np.ndarray, zeros: np.ndarray, bits: int, zero_offset: int) -> tuple:  # type: ignore[type-arg]
    per = 32 // bits
    qt = q.T  # [in, out]
    qweight = np.zeros((qt.shape[0] // per, qt.shape[1]), dtype=np.int64)
    for k in range(per):
        qweight |= qt[k::per] << (bits * k)
    stored = zeros - zero_offset
    qzeros = np.zeros((stored.shape[0], stored.shape[1] // per), dtype=np.int64)
    for k in range(per):
        qzeros |= stored[:, k::per] << (bits * k)
    return _to_int32(qweight), _to_int32(qzeros)


def pack_awq(q: np.ndarray, zeros: np.ndarray) -> tuple:  # type: ignore[type-arg]
    def pack(values: np.ndarray) -> torch.Tensor:  # [rows, out] -> [rows, out / 8]
        words = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.int64)
        for k, column in enumerate(AWQ_PACK_ORDER):
            words |= values[:, column::8] << (4 * k)
        return _to_int32(words)

    return pack(q.T), pack(zeros)


# The linear layers that read one input.
_SAME_INPUT = {
    "q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "mlp", "up_proj": "mlp",
    "w1": "mlp", "w3": "mlp",
}  # fmt: skip


def write_quantized(
    float_folder: Path, out: Path, reference: Path, method: str, bits: int, group_size: int,
    desc_act: bool = False, seed: int = 0, shared_order: bool = True,
) -> None:  # fmt: skip
    """`out`: float_folder's checkpoint with its linear layers quantized (method "gptq"
    or "awq"); `reference`: the same model with those layers' dequantized float32
    weights, and no quantization_config. With desc_act, the weights that read the same
    input (q/k/v, gate/up) share its activation order, as GPTQ's one Hessian of that
    input gives them, unless not `shared_order`."""
    rng = np.random.default_rng(seed)
    orders: dict[tuple[str, str], np.ndarray] = {}
    quantized, dequantized, linear = _linear_weights(float_folder)
    for name, module, w in linear:
        in_features = w.shape[1]
        groups = -(-in_features // group_size)
        layer, _, leaf = module.rpartition(".")
        key = (layer, _SAME_INPUT.get(leaf, leaf) if shared_order else leaf)
        if key not in orders:
            orders[key] = rng.permutation(in_features) if desc_act else np.arange(in_features)
        order = orders[key]
        group_of = np.empty(in_features, dtype=np.int64)
        group_of[order] = np.arange(in_features) // group_size
        q, scales, zeros, deq = quantize(w.double().numpy(), bits, group_of, groups)
        del quantized[name]
        if method == "gptq":
            qweight, qzeros = pack_gptq(q, zeros, bits, zero_offset=1)
            quantized[f"{module}.g_idx"] = torch.from_numpy(group_of.astype(np.int32))
        else:
            qweight, qzeros = pack_awq(q, zeros)
        quantized[f"{module}.qweight"] = qweight
        quantized[f"{module}.qzeros"] = qzeros
        quantized[f"{module}.scales"] = torch.from_numpy(scales)
        dequantized[name] = torch.from_numpy(deq.astype(np.float32))
    scheme = (
        {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
         "sym": False, "checkpoint_format": "gptq"}
        if method == "gptq"
        else {"quant_method": "awq", "bits": bits, "group_size": group_size,
              "zero_point": True, "version": "gemm"}
    )  # fmt: skip
    _write_folders(float_folder, out, reference, quantized, dequantized, scheme)


def _linear_weights(float_folder: Path) -> tuple[dict, dict, list]:  # type: ignore[type-arg]
    """(the quantized checkpoint's tensors, the reference's: both the float ones for now;
    (name, module, weight) of every linear layer's weight)."""
    tensors = load_file(str(float_folder / "model.safetensors"))
    linear = [
        (name, name.rpartition(".")[0], w)
        for name, w in tensors.items()
        if name.endswith(".weight") and name.rpartition(".")[0].rpartition(".")[2] in LINEAR
    ]
    return dict(tensors), dict(tensors), linear


def _write_folders(
    float_folder: Path, out: Path, reference: Path, quantized: dict, dequantized: dict,  # type: ignore[type-arg]
    quantization_config: dict,  # type: ignore[type-arg]
) -> None:  # fmt: skip
    """Both checkpoints, with the float folder's other files (tokenizer and the like);
    `out`'s config.json with `quantization_config`."""
    for folder, weights in ((out, quantized), (reference, dequantized)):
        folder.mkdir(parents=True, exist_ok=True)
        for extra in float_folder.iterdir():
            if extra.name not in ("model.safetensors", "config.json") and extra.is_file():
                shutil.copy(extra, folder / extra.name)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((float_folder / "config.json").read_text())
    (reference / "config.json").write_text(json.dumps(config))
    (out / "config.json").write_text(
        json.dumps({**config, "quantization_config": quantization_config})
    )


W8A8_CONFIG = {
    "quant_method": "compressed-tensors", "format": "int-quantized",
    "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                    "dynamic": False, "group_size": None},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                              "strategy": "token", "dynamic": True, "group_size": None},
    }},
}  # fmt: skip


# An int8 ("int") or fp8 ("float") kv_cache_scheme: static K and V scales per attention
# layer.
def kv_scheme(kv_type: str) -> dict:  # type: ignore[type-arg]
    return {"num_bits": 8, "type": kv_type, "symmetric": True, "strategy": "tensor",
            "dynamic": False}  # fmt: skip


def write_w8a8(
    float_folder: Path,
    out: Path,
    reference: Path,
    kv_scales: tuple[float, float] | None = None,
    kv_type: str = "int",
) -> None:
    """`out`: float_folder's checkpoint with its linear layers in compressed-tensors'
    int-quantized W8A8 form (`weight` int8 [out, in], `weight_scale` bfloat16 [out, 1]:
    w = q * scale per output channel, q = round(w / scale), scale = max|w| / 127);
    with kv_scales, a kv_cache_scheme of kv_type (int8 "int", fp8 "float") and each
    layer's `self_attn.k_scale` and `v_scale` (layer i's times 1 + i / 10, a scalar and a
    [1] alike); `reference`: the
    same model with the dequantized float32 weights."""
    quantized, dequantized, linear = _linear_weights(float_folder)
    layers = sorted({name.split(".")[2] for name, _, _ in linear}, key=int)
    for i, layer in enumerate(layers if kv_scales else []):
        assert kv_scales is not None
        k, v = (s * (1 + i / 10) for s in kv_scales)
        quantized[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        quantized[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([v])
    for name, module, w in linear:
        scale = (w.float().abs().amax(dim=1, keepdim=True) / 127).to(torch.bfloat16)
        q = torch.round(w.float() / scale.float()).clamp(-127, 127)
        quantized[name] = q.to(torch.int8)
        quantized[f"{module}.weight_scale"] = scale
        dequantized[name] = (q * scale.float()).float()
    config = {**W8A8_CONFIG, "kv_cache_scheme": kv_scheme(kv_type) if kv_scales else None}
    _write_folders(float_folder, out, reference, quantized, dequantized, config)


def w4a16_config(group_size: int, actorder: str | None = None) -> dict:  # type: ignore[type-arg]
    weights = {
        "num_bits": 4, "type": "int", "symmetric": True, "dynamic": False,
        "strategy": "group" if group_size > 0 else "channel",
        "group_size": group_size if group_size > 0 else None, "actorder": actorder,
    }  # fmt: skip
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": None}},
    }  # fmt: skip


def write_w4a16(
    float_folder: Path, out: Path, reference: Path, group_size: int,
    actorder: str | None = None, seed: int = 0,
) -> None:  # fmt: skip
    """`out`: float_folder's checkpoint with its linear layers in compressed-tensors'
    pack-quantized W4A16 form, packed by the compressed-tensors library itself
    (`weight_packed` int32 [out, in / 8], `weight_scale` bfloat16 [out, groups],
    `weight_shape`): q = round(w / scale) in [-8, 7], scale = max|w| / 7 per group
    (group_size -1: per output channel); with actorder "group", the groups are of inputs
    in a random activation order (shared by the weights of one input), given by
    `weight_g_idx` (int32 [in]); `reference`: the dequantized float32 weights."""
    from compressed_tensors.compressors import pack_to_int32

    rng = np.random.default_rng(seed)
    orders: dict[tuple[str, str], np.ndarray] = {}
    quantized, dequantized, linear = _linear_weights(float_folder)
    for name, module, w in linear:
        rows, columns = w.shape
        size = columns if group_size == -1 else group_size
        layer, _, leaf = module.rpartition(".")
        key = (layer, _SAME_INPUT.get(leaf, leaf))
        if key not in orders:
            orders[key] = rng.permutation(columns) if actorder == "group" else np.arange(columns)
        group_of = np.empty(columns, dtype=np.int64)
        group_of[orders[key]] = np.arange(columns) // size
        groups = torch.from_numpy(group_of)
        amax = torch.zeros(rows, columns // size).scatter_reduce_(
            1, groups.expand(rows, -1), w.float().abs(), "amax"
        )
        scale = (amax / 7).to(torch.bfloat16)
        q = torch.round(w.float() / scale.float()[:, groups]).clamp(-8, 7)
        del quantized[name]
        quantized[f"{module}.weight_packed"] = pack_to_int32(q.to(torch.int8), 4)
        quantized[f"{module}.weight_scale"] = scale
        quantized[f"{module}.weight_shape"] = torch.tensor([rows, columns])
        if actorder == "group":
            quantized[f"{module}.weight_g_idx"] = groups.to(torch.int32)
        dequantized[name] = q * scale.float()[:, groups]
    _write_folders(
        float_folder, out, reference, quantized, dequantized, w4a16_config(group_size, actorder)
    )


# FP8_BLOCK's blocks of [out, in] weights and groups of inputs for the tiny models (its
# preset's 128 x 128 and 128 cover their matrices whole).
FP8_BLOCK, FP8_GROUP = (32, 64), 64


def fp8_config(strategy: str, activations: str | None) -> dict:  # type: ignore[type-arg]
    """compressed-tensors' float-quantized FP8 scheme: weights per `strategy` ("channel",
    "tensor" or "block": FP8_BLOCK); activations "token" (dynamic), "group" (dynamic, per
    FP8_GROUP inputs), "tensor" (static) or None (float)."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
               "dynamic": False, "group_size": None,
               "block_structure": list(FP8_BLOCK) if strategy == "block" else None}  # fmt: skip
    inputs = activations and {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": activations,
        "dynamic": activations in ("token", "group"),
        "group_size": FP8_GROUP if activations == "group" else None,
    }  # fmt: skip
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": inputs}},
    }  # fmt: skip


# Static activation scales as a calibration gives them (max|x| / 448 over the test's
# prompts on the tiny llama, rounded up); those of the parts of a layer that read one
# input differ, so that a reader must take their largest.
_STATIC_INPUT_SCALE = {"q_proj": 0.0100, "k_proj": 0.0110, "v_proj": 0.0105, "o_proj": 0.0060,
                       "gate_proj": 0.0100, "up_proj": 0.0105, "down_proj": 0.0160}  # fmt: skip


def _block_amax(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """max|w| of each block of [bo, bi] weights, [ceil(out / bo), ceil(in / bi)]."""
    bo, bi = block
    rows, cols = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
    return torch.tensor([[float(w[a * bo : (a + 1) * bo, b * bi : (b + 1) * bi].abs().max())
                          for b in range(cols)] for a in range(rows)])  # fmt: skip


def block_scales(
    scale: torch.Tensor, shape: torch.Size, block: tuple[int, int] = FP8_BLOCK
) -> torch.Tensor:
    """A weight_scale ([out, 1], [1], or per block of [bo, bi]) for each weight of `shape`."""
    if scale.dim() < 2 or scale.shape == (shape[0], 1):
        return scale.reshape(-1, 1).expand(shape)
    bo, bi = block
    return scale.repeat_interleave(bo, 0)[: shape[0]].repeat_interleave(bi, 1)[:, : shape[1]]


def write_fp8(
    float_folder: Path, out: Path, reference: Path, strategy: str, activations: str | None
) -> None:
    """`out`: float_folder's checkpoint with its linear layers in compressed-tensors'
    float-quantized FP8 form, compressed by the compressed-tensors library itself
    (`weight` float8_e4m3fn [out, in], `weight_scale` max|w| / 448 per output channel
    (bfloat16 [out, 1]), per tensor (float32 [1]) or per FP8_BLOCK block (float32
    [ceil(out / bo), ceil(in / bi)]), and with static activations an
    `input_scale` [1]); `reference`: the same model with the dequantized float32 weights
    (e4m3 * scale, as the library decompresses them)."""
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    group = fp8_config(strategy, activations)["config_groups"]["group_0"]
    scheme = QuantizationScheme(**group)
    quantized, dequantized, linear = _linear_weights(float_folder)
    for name, module, w in linear:
        if strategy == "channel":
            scale = (w.float().abs().amax(dim=1, keepdim=True) / 448).to(torch.bfloat16)
        elif strategy == "block":
            scale = _block_amax(w.float()) / 448
        else:
            scale = (w.float().abs().amax() / 448).reshape(1)
        compressed = FloatQuantizationCompressor.compress(
            {"weight": w.float(), "weight_scale": scale}, scheme
        )
        quantized[name] = compressed["weight"]
        quantized[f"{module}.weight_scale"] = scale
        if activations == "tensor":
            leaf = module.rpartition(".")[2]
            quantized[f"{module}.input_scale"] = torch.tensor([_STATIC_INPUT_SCALE[leaf]])
        dequantized[name] = compressed["weight"].float() * block_scales(scale.float(), w.shape)
    _write_folders(
        float_folder, out, reference, quantized, dequantized, fp8_config(strategy, activations)
    )


def write_fp8_blocks(
    float_folder: Path, out: Path, reference: Path, block: tuple[int, int]
) -> None:
    """`out`: float_folder's checkpoint in the fp8 quant_method's form, as DeepSeek-V3
    ships (`weight` float8_e4m3fn [out, in], `weight_scale_inv` float32
    [ceil(out / bo), ceil(in / bi)] = max|w| / 448 of each block, by which the e4m3
    values are multiplied back; activations dynamic per group of bi inputs);
    `reference`: the same model with those dequantized float32 weights."""
    quantized, dequantized, linear = _linear_weights(float_folder)
    for name, module, w in linear:
        scale = _block_amax(w.float(), block) / 448
        per_weight = block_scales(scale, w.shape, block)
        q = (w.float() / per_weight).clamp(-448, 448).to(torch.float8_e4m3fn)
        quantized[name] = q
        quantized[f"{module}.weight_scale_inv"] = scale
        dequantized[name] = q.float() * per_weight
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
              "weight_block_size": list(block)}  # fmt: skip
    _write_folders(float_folder, out, reference, quantized, dequantized, config)
