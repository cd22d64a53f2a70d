"""The KV-cache property machines' shadow of the model runner: what each slot of each
block holds (device and host tier), moved as a step's copies move it."""

from __future__ import annotations

from typing import Any


def run_copies(
    kv: Any, slots: dict[int, dict[int, Any]], host_slots: dict[int, dict[int, Any]]
) -> None:
    """The copies the manager queued, as the model runner runs them before a step: out
    to the host tier, in from it, then copy-on-write."""
    to_host, to_device = kv.take_pending_transfers()
    for src, dst in to_host:
        host_slots[dst] = dict(slots.get(src, {}))
    for src, dst in to_device:
        slots[dst] = dict(host_slots.get(src, {}))
    for src, dst in kv.take_pending_copies():
        slots[dst] = dict(slots.get(src, {}))
