"""Multi-LoRA: PEFT adapters over one base model, mixed in one batch (docs/lora.md)."""

from pyengine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
