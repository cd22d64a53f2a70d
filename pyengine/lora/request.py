"""What a request names its adapter by, as vLLM's LoRARequest."""

from __future__ import annotations

from dataclasses import dataclass

from pyengine.sampling_params import is_int


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: its name (the server's model name for it), its id (unique among the
    engine's adapters, > 0: the scheduler's and the prefix cache's key; 0 is the base
    model) and the PEFT folder it loads from (adapter_config.json and
    adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not is_int(self.lora_int_id) or self.lora_int_id < 1:
            raise ValueError(
                f"lora_int_id must be a positive integer (0 is the base model), got "
                f"{self.lora_int_id!r}"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")
