"""The engine's side of the adapters: each request's LoRARequest checked when it arrives,
so that a bad adapter is a clear error at add_request, never a failed step."""

from __future__ import annotations

from pyengine.config import LoRAConfig, ModelConfig
from pyengine.lora.adapter import check_adapter
from pyengine.lora.request import LoRARequest


class AdapterRegistry:
    def __init__(self, config: LoRAConfig | None, model_config: ModelConfig) -> None:
        self.config, self.model_config = config, model_config
        self.known: dict[int, LoRARequest] = {}  # checked, by id

    def check(self, request: LoRARequest | None) -> None:
        """ValueError naming the problem where `request` cannot run: LoRA not enabled, an
        id already another adapter's, or the adapter's own (check_adapter: its config and
        tensors' shapes, its weights left for the worker to read)."""
        if request is None:
            return
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {request!r:.80}")
        if self.config is None:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r}: the engine runs without adapters "
                "(start it with enable_lora=True)"
            )
        known = self.known.get(request.lora_int_id)
        if known == request:
            return
        if known is not None:
            raise ValueError(
                f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} "
                f"({known.lora_path}); {request.lora_name!r} needs an id of its own"
            )
        check_adapter(request, self.model_config, self.config.max_lora_rank)
        self.known[request.lora_int_id] = request
