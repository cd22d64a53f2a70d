"""A step's failure that some of its requests caused: what they brought (their adapter,
whose files vanished after it was checked, say), not the engine. The engine core retries
the step without them, and only they fail; any other failure fails the whole step. It
crosses from a worker process to the driver whole (it pickles), where other errors come
as their text."""

from __future__ import annotations

from typing import Any


class RequestFault(Exception):
    """Raised where a step fails for what its requests named: `lora_int_ids`, their
    adapters; `request_ids`, the requests themselves."""

    def __init__(
        self, message: str, lora_int_ids: tuple[int, ...] = (), request_ids: tuple[str, ...] = ()
    ) -> None:
        super().__init__(message)
        self.message = message
        self.lora_int_ids = tuple(lora_int_ids)
        self.request_ids = tuple(request_ids)

    def __reduce__(self) -> tuple[Any, ...]:
        return RequestFault, (self.message, self.lora_int_ids, self.request_ids)
