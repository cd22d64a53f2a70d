"""The recurrent states of one layer of a hybrid model (Gated DeltaNet, Mamba-2): each
request's state lives in a slot of the layer's tensors, named per step, so that a step
may mix prefills, chunks of prefills and decodes (pyengine/recurrent.h's kernels)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
