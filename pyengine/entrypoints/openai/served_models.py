"""The names a request's `model` field may take: the base model's (--served-model-name)
and each LoRA adapter's (--lora-modules name=path, or loaded at run time), as vLLM's
server names them."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from pyengine.entrypoints.openai.errors import APIError
from pyengine.lora.request import LoRARequest


@dataclass
class ServedModels:
    base_names: list[str]
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    _next_id: int = 1
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def base_name(self) -> str:
        return self.base_names[0]

    def resolve(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """(the name the response reports, the adapter or None) of a request's `model`;
        404 where it names none."""
        if model is None or model in self.base_names:
            return self.base_name, None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise APIError(f"The model `{model}` does not exist.", status=404, param="model")
        return model, adapter

    def new_adapter(self, name: str, path: str) -> LoRARequest:
        """A LoRARequest of an id of its own (ids are never reused: the prefix cache keys
        blocks by them). 400 where the name is taken."""
        with self._lock:
            if name in self.base_names or name in self.adapters:
                raise APIError(f"The model name `{name}` is already served.", param="lora_name")
            request = LoRARequest(name, self._next_id, path)
            self._next_id += 1
            return request

    def add(self, request: LoRARequest) -> None:
        with self._lock:
            self.adapters[request.lora_name] = request

    def remove(self, name: str) -> LoRARequest:
        with self._lock:
            adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise APIError(f"The LoRA adapter `{name}` is not loaded.", status=404,
                           param="lora_name")  # fmt: skip
        return adapter


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """--lora-modules name=path ...: (name, path) pairs; ValueError naming a bad one."""
    pairs = []
    for value in values or []:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {value!r} is not name=path")
        pairs.append((name, path))
    return pairs
