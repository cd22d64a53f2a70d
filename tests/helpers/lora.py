"""PEFT LoRA adapters made for the tests, and what transformers + peft generate with them."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(20, 60))]
NEW_TOKENS = 10


def make_adapter(
    base: torch.nn.Module, folder: Path, seed: int, rank: int = 8, modules: list[str] = ALL_MODULES,
    rslora: bool = False,
) -> torch.nn.Module:  # fmt: skip
    """A peft LoRA adapter of `base` with random A and B (peft's init_lora_weights=False
    leaves B random too), saved to folder; the peft model."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules,
                             init_lora_weights=False, use_rslora=rslora)  # fmt: skip
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return model


def write_random_adapter(config: object, folder: Path, seed: int, rank: int = 8) -> None:
    """A PEFT folder written in PEFT's layout (no peft needed) for every projection of a
    model of `config` (a ModelConfig): random A and B, large enough to change its tokens."""
    import json

    from safetensors.torch import save_file

    from pyengine.lora.adapter import TARGET_MODULES, projection_shape

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):  # type: ignore[attr-defined]
        for module in TARGET_MODULES:
            out, inp = projection_shape(config, module)  # type: ignore[arg-type]
            parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=generator) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.1
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none",
                      "target_modules": list(TARGET_MODULES)}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config))
