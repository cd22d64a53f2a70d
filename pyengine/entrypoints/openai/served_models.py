"""The names a request's `model` field may take: the base model's (--served-model-name)
and each LoRA adapter's (--lora-modules name=path, or loaded at run time), as vLLM's
server names them; and who may load and unload adapters at run time, from where."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from pyengine.entrypoints.openai.errors import APIError
from pyengine.lora.request import LoRARequest


@dataclass
class ServedModels:
    base_names: list[str]
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    max_adapters: int | None = None  # None: no bound
    # The API key (its index) that loaded each run-time adapter: only it unloads it.
    owners: dict[str, int] = field(default_factory=dict)
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
        blocks by them). 400 where the name is taken or the adapters are at their bound."""
        with self._lock:
            self._check_room(name)
            request = LoRARequest(name, self._next_id, path)
            self._next_id += 1
            return request

    def _check_room(self, name: str) -> None:
        if name in self.base_names or name in self.adapters:
            raise APIError(f"The model name `{name}` is already served.", param="lora_name")
        if self.max_adapters is not None and len(self.adapters) >= self.max_adapters:
            raise APIError(
                f"the server serves {len(self.adapters)} adapters, its bound "
                "(--max-lora-adapters): unload one first", param="lora_name",
            )  # fmt: skip

    def add(self, request: LoRARequest, owner: int | None = None) -> None:
        with self._lock:
            self._check_room(request.lora_name)  # (again: another may have come first)
            self.adapters[request.lora_name] = request
            if owner is not None:
                self.owners[request.lora_name] = owner

    def remove(self, name: str, owner: int | None = None) -> LoRARequest:
        """Stops serving adapter `name`; with `owner`, only where that key loaded it (an
        adapter of the command line's is any admin's)."""
        with self._lock:
            loaded_by = self.owners.get(name, owner)
            if name in self.adapters and owner is not None and loaded_by != owner:
                raise APIError(f"The LoRA adapter `{name}` was loaded with another API key.",
                               status=403, param="lora_name")  # fmt: skip
            adapter = self.adapters.pop(name, None)
            self.owners.pop(name, None)
        if adapter is None:
            raise APIError(f"The LoRA adapter `{name}` is not loaded.", status=404,
                           param="lora_name")  # fmt: skip
        return adapter


def path_inside(root: str, path: str) -> str:
    """`path` (relative to `root`, or absolute), its links resolved, where it lies inside
    `root`; else 400 with the same message whatever is, or is not, at the path: a caller
    learns nothing of the server's files outside the root."""
    base = Path(root).resolve()
    resolved = (base / path).resolve()  # (an absolute path replaces the base)
    if not resolved.is_relative_to(base) or resolved == base:
        raise APIError(
            "lora_path must name an adapter's folder inside the server's LoRA root "
            "(--lora-root)", param="lora_path",
        )  # fmt: skip
    return os.fspath(resolved)


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """--lora-modules name=path ...: (name, path) pairs; ValueError naming a bad one."""
    pairs = []
    for value in values or []:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {value!r} is not name=path")
        pairs.append((name, path))
    return pairs
