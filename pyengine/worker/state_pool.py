"""The recurrent states of a hybrid model's layers (Gated DeltaNet, Mamba-2): for each
such layer of this stage, a conv and a recurrent tensor of `num_slots` slots. The
KV-cache manager owns the slots as it owns blocks (a request takes one at its first
allocation, frees it at its end; a forked sample takes its own and a copy of its
parent's), and the scheduler names each request's per step (StepBuffers.state_slots)."""

from __future__ import annotations

import math
from typing import Any

import torch

from pyengine.layers.recurrent_state import StateCache, StateLayer

# States are float32 whatever the model's dtype: the recurrences accumulate over every
# token of a request, as transformers' and vLLM's float32 state caches do.
STATE_DTYPE = torch.float32


def state_layers(model: Any) -> list[StateLayer]:
    """The model's layers that keep a recurrent state, in order."""
    return [m for m in model.modules() if isinstance(m, StateLayer)]


def slot_bytes(layers: list[StateLayer]) -> int:
    """Bytes of one slot in every layer: what one more running request costs."""
    itemsize = STATE_DTYPE.itemsize
    return sum(sum(math.prod(s) for s in layer.state_shapes()) for layer in layers) * itemsize


def slots_within(layers: list[StateLayer], wanted: int, budget: int) -> int:
    """How many slots of `layers` to allocate: `wanted` (one per request the scheduler
    may run), or as many as half of `budget` (the KV cache's bytes) holds, whichever is
    fewer, and at least one; the scheduler then admits requests as slots free."""
    per_slot = slot_bytes(layers)
    if not layers or per_slot == 0:
        return 0
    return max(1, min(wanted, budget // 2 // per_slot))


def allocate_states(
    layers: list[StateLayer], num_slots: int, device: torch.device
) -> list[StateCache]:
    """Zeroed state tensors of `num_slots` slots, one (conv, recurrent) pair a layer."""
    return [
        tuple(torch.zeros(num_slots, *shape, dtype=STATE_DTYPE, device=device)
              for shape in layer.state_shapes())  # type: ignore[misc]
        for layer in layers
    ]  # fmt: skip


def copy_states(states: list[StateCache], copies: list[tuple[int, int]]) -> None:
    """Each (source, destination) slot's states copied, in every layer (a forked sample
    starts from its parent's)."""
    if not copies:
        return
    source = torch.tensor([s for s, _ in copies], dtype=torch.int64)
    destination = torch.tensor([d for _, d in copies], dtype=torch.int64)
    for pair in states:
        for tensor in pair:
            on = source.to(tensor.device), destination.to(tensor.device)
            tensor[on[1]] = tensor[on[0]]
