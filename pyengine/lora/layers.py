"""Batched LoRA in the linear layers: each adapted layer holds max_loras slots of (A, B)
on the model's device, and adds to the base product, computed once for the whole step,
each token row's delta through its adapter's slot: on the CPU one call of ops.lora_add
(C++: the rows of a slot together, a shrink x @ A.T to the rank, then an expand @ B.T,
Punica's SGMV), elsewhere the same per adapter in torch; rows without an adapter are
left as they are.

A layer's slots follow its tensor-parallel shard: a column-parallel layer (q/k/v,
gate/up) holds the rows of B of its output shard and all of A; a row-parallel one (o,
down) the columns of A of its input shard and all of B, its partial deltas summed with
the partial products by the all-reduce that follows. The LM head is a column-parallel
layer over the vocabulary (its own rows: the sampled ones); the embedding adds its delta
to the looked-up rows after they are summed over the ranks, each holding all of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pyengine import ops
from pyengine.lora.adapter import MODEL_LAYER, LoRAAdapter


class LoRABatch:
    """The step's token rows of each resident adapter, shared by every layer's hook: each
    row's slot in the first rows of one buffer (which a recorded decode step's kernel
    calls read in place, as the step inputs), and the rows of each slot (torch's path)."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.buffer = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.slots = self.buffer[:0]  # int32 [tokens], each row's slot (-1: none)
        self._token_slots = np.zeros(0, dtype=np.int64)
        self._groups: list[tuple[int, torch.Tensor | None]] | None = []

    def slots_for(self, tokens: int) -> torch.Tensor:
        return self.slots if self.slots.shape[0] == tokens else self.buffer[:tokens]

    def clear(self) -> None:
        self.set_rows(np.zeros(0, dtype=np.int64))

    def set_rows(self, token_slots: np.ndarray) -> None:
        """token_slots: int [tokens], each row's slot (-1: no adapter); the buffer's rows
        past them, which a recorded step of more rows reads, none."""
        n = len(token_slots)
        self.buffer[:n].copy_(torch.from_numpy(token_slots.astype(np.int32)))
        self.buffer[n:].fill_(-1)
        self.slots = self.buffer[:n]
        self._token_slots, self._groups = token_slots, None

    @property
    def groups(self) -> list[tuple[int, torch.Tensor | None]]:
        """(slot, its rows as an int64 tensor on the device, or None: every row) of each
        resident adapter in the step: made on first use (only torch's path reads them)."""
        if self._groups is None:
            slots = np.unique(self._token_slots)
            self._groups = []
            for slot in slots[slots >= 0]:
                rows = None if len(slots) == 1 else np.flatnonzero(self._token_slots == slot)
                on_device = None if rows is None else torch.from_numpy(rows).to(self.buffer.device)
                self._groups.append((int(slot), on_device))
        return self._groups


@dataclass(frozen=True)
class _Part:
    """A stacked part of the layer's output: its module, where its rows sit in the
    layer's output shard, and which rows (column-parallel) or columns (row-parallel) of
    the full projection the shard holds."""

    module: str
    out_offset: int
    out_length: int
    shard: slice  # of B's rows (column-parallel) or A's columns (row-parallel)


class LoRASlots:
    """A linear layer's adapter hook (layers/linear.py's AdapterHook). Its parts' A are
    stacked, [slots, parts * rank, in]; so are their B transposed, [slots, parts * rank,
    out], part p's rank rows over its own columns: one call of ops.lora_add (the CPU's
    kernel) adds a step's deltas, or, elsewhere, a shrink and an expand per adapter."""

    def __init__(
        self,
        layer_index: int,
        parts: list[_Part],
        row_parallel: bool,
        in_features: int,
        batch: LoRABatch,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layer_index, self.parts, self.row_parallel = layer_index, parts, row_parallel
        self.batch, self.rank = batch, max_rank
        ranks, out = len(parts) * max_rank, sum(p.out_length for p in parts)
        self.a = torch.zeros(max_loras, ranks, in_features, dtype=dtype, device=device)
        self.b_t = torch.zeros(max_loras, ranks, out, dtype=dtype, device=device)
        self.scale = torch.zeros(max_loras, dtype=torch.float32, device=device)
        columns = [0, *np.cumsum([p.out_length for p in parts]).tolist()]
        self.part_columns = torch.tensor(columns, dtype=torch.int64)  # (on the CPU, always)
        # ops.lora_add: on the CPU in float32 and bfloat16; on CUDA with
        # PYENGINE_CUDA_LORA_KERNEL=1, until bench/gpu/run.sh has run it on a GPU; else torch.
        self.kernel = _cpu_kernel(dtype, device) or (
            device.type == "cuda" and os.environ.get("PYENGINE_CUDA_LORA_KERNEL") == "1"
        )

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Slot `slot` takes `adapter`'s weights for this layer (zeros where it leaves a
        part out, and past its rank)."""
        self.a[slot].zero_()
        self.b_t[slot].zero_()
        self.scale[slot] = adapter.scale
        r = adapter.rank
        for p, part in enumerate(self.parts):
            weights = adapter.weights.get((self.layer_index, part.module))
            if weights is None:
                continue
            a, b = weights.a, weights.b
            if self.row_parallel:
                a = a[:, part.shard]
            else:
                b = b[part.shard]
            ranks = slice(p * self.rank, p * self.rank + r)
            self.a[slot, ranks].copy_(a)
            # (the LM head's last shard may pass the vocabulary: those columns stay zero)
            columns = slice(part.out_offset, part.out_offset + b.shape[0])
            self.b_t[slot, ranks, columns].copy_(b.t())

    def add_delta(self, layer: object, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.kernel:  # (called whatever the step's adapters: a recorded step replays it)
            slots = self.batch.slots_for(x.shape[0])
            ops.lora_add(out, x, self.a, self.b_t, slots, self.scale, self.part_columns)
            return out
        for slot, rows in self.batch.groups:
            xs = x if rows is None else x.index_select(0, rows)
            shrunk = xs @ self.a[slot].t()  # [rows, parts * rank]
            for p, part in enumerate(self.parts):
                ranks = slice(p * self.rank, (p + 1) * self.rank)
                columns = slice(part.out_offset, part.out_offset + part.out_length)
                expanded = shrunk[:, ranks] @ self.b_t[slot, ranks, columns]
                expanded *= self.scale[slot]
                if rows is None:
                    out[:, columns] += expanded
                else:
                    out[:, columns].index_add_(0, rows, expanded)
        return out


class LoRAEmbeddingSlots:
    """The embedding's adapter hook (layers/vocab_embedding.py): each slot's A transposed,
    [slots, vocab, rank], and B transposed, [slots, rank, hidden]; a row's delta is its
    token's row of A times B, on the CPU one call of ops.lora_embedding_add."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        batch: LoRABatch,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.batch = batch
        self.a_t = torch.zeros(max_loras, vocab_size, max_rank, dtype=dtype, device=device)
        self.b_t = torch.zeros(max_loras, max_rank, hidden_size, dtype=dtype, device=device)
        self.scale = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.kernel = _cpu_kernel(dtype, device)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        self.a_t[slot].zero_()
        self.b_t[slot].zero_()
        self.scale[slot] = adapter.scale
        weights = adapter.weights.get((MODEL_LAYER, "embed_tokens"))
        if weights is not None:
            self.a_t[slot, :, : adapter.rank].copy_(weights.a.t())
            self.b_t[slot, : adapter.rank].copy_(weights.b.t())

    def add_delta(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [tokens, hidden], the rows of ids [tokens], + their delta (in place)."""
        if self.kernel:  # (called whatever the step's adapters: a recorded step replays it)
            slots = self.batch.slots_for(ids.shape[0])
            ops.lora_embedding_add(out, ids, self.a_t, self.b_t, slots, self.scale)
            return out
        for slot, rows in self.batch.groups:
            picked = ids if rows is None else ids.index_select(0, rows)
            delta = (F.embedding(picked, self.a_t[slot]) @ self.b_t[slot]) * self.scale[slot]
            if rows is None:
                out += delta.to(out.dtype)
            else:
                out.index_add_(0, rows, delta.to(out.dtype))
        return out


def _cpu_kernel(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the CPU's kernels (ops.lora_add, ops.lora_embedding_add) take the tables."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
