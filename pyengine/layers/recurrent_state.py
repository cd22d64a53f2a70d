"""The recurrent states of one layer of a hybrid model (Gated DeltaNet, Mamba-2): each
request's state lives in a slot of the layer's tensors, named per step, so that a step
may mix prefills, chunks of prefills and decodes (pyengine/recurrent.h's kernels)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from pyengine.distributed import TensorParallelGroup

# One layer's state tensors: (conv [num_slots, ...], recurrent [num_slots, ...]).
StateCache = tuple[torch.Tensor, torch.Tensor]


@runtime_checkable
class StateLayer(Protocol):
    """A layer that keeps a recurrent state per request. The model runner finds these
    among a model's modules, in layer order, allocates their slots, numbers them
    (state_index) and hands every one's tensors to each step (the metadata's `states`),
    as it tells an attention layer its KV-cache group: a layer may then attend and keep
    a state both (Falcon-H1's)."""

    state_index: int

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's (conv, recurrent) shapes on this rank (float32)."""
        ...


@dataclass
class RecurrentStates:
    """One layer's states and which requests of the step use which slot.
    conv: [num_slots, conv_channels, conv_width - 1] (the short convolution's last
    inputs); recurrent: [num_slots, ...] (the layer's own state: Gated DeltaNet's
    [value_heads, key_dim, value_dim], Mamba-2's [heads, head_dim, state_size]); slots,
    has_state (0: the slot is new, read as zeros): int32 [num_reqs]; query_start_loc:
    int32 [num_reqs + 1]."""

    conv: torch.Tensor
    recurrent: torch.Tensor
    slots: torch.Tensor
    has_state: torch.Tensor
    query_start_loc: torch.Tensor

    @classmethod
    def of_step(cls, meta: StepSlots, index: int) -> RecurrentStates:
        """State layer `index`'s states for the step `meta`."""
        if meta.states is None or meta.state_slots is None or meta.has_state is None:
            raise ValueError("a recurrent layer ran in a step that names no state slots")
        conv, recurrent = meta.states[index]
        return cls(conv, recurrent, meta.state_slots, meta.has_state, meta.query_start_loc)


def rank_sections(wholes: tuple[int, ...], tp: TensorParallelGroup) -> list[tuple[int, int, int]]:
    """(whole, this rank's first, its count) of each section of a tensor whose sections
    are split over the ranks alike (a short convolution's channels: WeightRouter.sections)."""
    world = tp.world_size
    return [(whole, tp.rank * whole // world, whole // world) for whole in wholes]


def mixer_parameter(*shape: int, device: torch.device) -> nn.Parameter:
    """A mixer's float32 parameter (its convolution, decays, norm), loaded later."""
    return nn.Parameter(torch.zeros(*shape, device=device), requires_grad=False)


class StepSlots(Protocol):
    """What of a step's metadata (AttentionMetadata) names the requests' slots."""

    states: list[StateCache] | None
    state_slots: torch.Tensor | None
    has_state: torch.Tensor | None
    query_start_loc: torch.Tensor
