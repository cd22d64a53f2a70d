"""How a model's layers share the paged KV cache: its KV-cache groups and the page slot
of each layer (see docs/architecture.md, "The hybrid KV cache").

Layers of one attention kind (full, a sliding window, chunked local attention) read the
same positions, so they can share one block table. A model of one kind is one group of
all its layers. A hybrid model's layers are split into groups of equal size, one kind
each (the full groups first), so that one block of the pool, a page for each of the
group size's slots, serves a group of any kind: the i-th layer of every group writes
slot i. A request then holds a block table per group, and a window's group releases
blocks that no later query reads, so its memory is bounded by the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pyengine import _C
from pyengine.layers.attention import PagedAttention
from pyengine.layers.latent_attention import LatentAttention

# A layer's attention as the KV-cache manager groups it: ("full", 0), ("sliding",
# window) or ("chunked", chunk).
KVSpec = tuple[str, int]

FULL: KVSpec = ("full", 0)


@dataclass(frozen=True)
class KVLayout:
    """groups: each group's spec, in the KV-cache manager's order; layer_slots: each
    layer's (group, slot); num_slots: the pages of one block."""

    groups: tuple[KVSpec, ...]
    layer_slots: tuple[tuple[int, int], ...]
    num_slots: int

    def slots_of(self, layers: range) -> list[int]:
        """The slots that `layers` (a pipeline stage's) write, in order."""
        return sorted({self.layer_slots[i][1] for i in layers})

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int, block_size: int) -> int:
        """The most blocks of all groups one request of `num_tokens` tokens holds at once
        (the scheduler's admission bound, kv_group.h's max_blocks_held): a full group all
        of its blocks; a window's group those its step's queries may read."""
        return _C.kv_max_blocks_held(list(self.groups), block_size, num_tokens, max_step_tokens)


def plan_kv_layout(specs: list[KVSpec]) -> KVLayout:
    """The groups of layers with these specs (one per layer, in order)."""
    if not specs:
        raise ValueError("a model without attention layers has no KV cache to lay out")
    by_spec: dict[KVSpec, list[int]] = {}
    for index, spec in sorted(enumerate(specs), key=lambda item: item[1][0] != "full"):
        by_spec.setdefault(spec, []).append(index)
    size = min(len(layers) for layers in by_spec.values())
    groups: list[KVSpec] = []
    slots: dict[int, tuple[int, int]] = {}
    for spec, layers in by_spec.items():
        for start in range(0, len(layers), size):
            for slot, index in enumerate(layers[start : start + size]):
                slots[index] = (len(groups), slot)
            groups.append(spec)
    return KVLayout(tuple(groups), tuple(slots[i] for i in range(len(specs))), size)


def assign_kv_groups(model: Any, layout: KVLayout, layers: range) -> None:
    """Tells each attention layer of `model` (a pipeline stage's `layers`, in order) its
    KV-cache group. Raises ValueError where the model's attention layers are not one a
    layer, or one's window is not its group's (the layout was made from another config)."""
    found = (getattr(m, "attn", None) for m in model.modules())
    attentions = [a for a in found if isinstance(a, PagedAttention | LatentAttention)]
    if len(attentions) != len(layers):
        raise ValueError(
            f"the model has {len(attentions)} attention layers where its KV cache lays out "
            f"{len(layers)}"
        )
    for attention, index in zip(attentions, layers, strict=True):
        group = layout.layer_slots[index][0]
        kind, size = layout.groups[group]
        if (attention.sliding_window, attention.attention_chunk) != (
            size if kind == "sliding" else 0,
            size if kind == "chunked" else 0,
        ):
            raise ValueError(
                f"layer {index} attends within a window of {attention.sliding_window} and "
                f"chunks of {attention.attention_chunk} (0: none), but its KV-cache group is "
                f"{kind} ({size})"
            )
        attention.kv_group = group
