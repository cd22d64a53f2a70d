"""How a model's layers share the paged KV cache: its KV-cache groups and the page slot
of each layer (see docs/architecture.md, "The hybrid KV cache").

Layers of one attention kind (full, a sliding window, chunked local attention) read the
same positions, so they can share one block table. A model of one kind is one group of
all its layers. A hybrid model's layers are split into groups of equal size, one kind
each (the full groups first), so that one block of the pool, a page for each of the
group size's slots, serves a group of any kind: the i-th layer of every group writes
slot i. A request then holds a block table per group, and a window's group releases
blocks that no later query reads, so its memory is bounded by the window.

A hybrid model's recurrent layers (Gated DeltaNet, Mamba-2) keep a state per request in
slots of their own (worker/state_pool.py) and no KV cache: their spec is RECURRENT, and
they are in no group; nor are an encoder's layers (NO_CACHE), which keep nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pyengine import _C
from pyengine.config import NO_CACHE_SPEC, RECURRENT_SPEC
from pyengine.layers.attention import PagedAttention
from pyengine.layers.latent_attention import LatentAttention

# A layer's attention as the KV-cache manager groups it: ("full", 0), ("sliding",
# window) or ("chunked", chunk).
KVSpec = tuple[str, int]

FULL: KVSpec = ("full", 0)
RECURRENT: KVSpec = RECURRENT_SPEC  # a layer with a recurrent state, not a KV cache
NO_CACHE: KVSpec = NO_CACHE_SPEC  # an encoder's layer: nothing kept between steps
PAGELESS = (RECURRENT, NO_CACHE)


@dataclass(frozen=True)
class KVLayout:
    """groups: each group's spec, in the KV-cache manager's order; layer_slots: each
    layer's (group, slot), (-1, -1) for a layer without pages; num_slots: the pages of one
    block (0: the model has no attention layer)."""

    groups: tuple[KVSpec, ...]
    layer_slots: tuple[tuple[int, int], ...]
    num_slots: int

    def slots_of(self, layers: range) -> list[int]:
        """The slots that `layers` (a pipeline stage's) write, in order."""
        return sorted({self.layer_slots[i][1] for i in layers} - {-1})

    def is_recurrent(self, layer: int) -> bool:
        """Whether the layer has no pages (a recurrent layer's state, or an encoder's
        nothing)."""
        return self.layer_slots[layer][0] < 0

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int, block_size: int) -> int:
        """The most blocks of all groups one request of `num_tokens` tokens holds at once
        (the scheduler's admission bound, kv_group.h's max_blocks_held): a full group all
        of its blocks; a window's group those its step's queries may read."""
        return _C.kv_max_blocks_held(list(self.groups), block_size, num_tokens, max_step_tokens)


def plan_kv_layout(specs: list[KVSpec]) -> KVLayout:
    """The groups of layers with these specs (one per layer, in order); recurrent layers
    are in none. A model of recurrent layers alone (Mamba-2's) keeps one full group of
    no slots, so that the KV-cache manager still counts each request's tokens in
    blocks (which then hold nothing); so does an encoder's."""
    if not specs:
        raise ValueError("a model without layers has no KV cache to lay out")
    by_spec: dict[KVSpec, list[int]] = {}
    attention = [(i, spec) for i, spec in enumerate(specs) if spec not in PAGELESS]
    for index, spec in sorted(attention, key=lambda item: item[1][0] != "full"):
        by_spec.setdefault(spec, []).append(index)
    slots: dict[int, tuple[int, int]] = {i: (-1, -1) for i, s in enumerate(specs) if s in PAGELESS}
    if not by_spec:
        return KVLayout((FULL,), tuple(slots[i] for i in range(len(specs))), 0)
    size = min(len(layers) for layers in by_spec.values())
    groups: list[KVSpec] = []
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
    attending = [i for i in layers if not layout.is_recurrent(i)]
    if len(attentions) != len(attending):
        raise ValueError(
            f"the model has {len(attentions)} attention layers where its KV cache lays out "
            f"{len(attending)}"
        )
    for attention, index in zip(attentions, attending, strict=True):
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
