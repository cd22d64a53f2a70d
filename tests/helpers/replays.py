"""The steps a model runner's decode graphs (CUDA graphs, recorded CPU steps) replay."""

from __future__ import annotations

from typing import Any


def count_replays(graphs: Any) -> list[tuple[int, int | None]]:
    """A list that fills, as steps run, with (requests, the size that replayed the step or
    None) of every step `graphs` (DecodeGraphs or KernelGraphs) is asked about."""
    replays: list[tuple[int, int | None]] = []
    size_for = graphs.size_for

    def counted(b: Any) -> int | None:
        size = size_for(b)
        replays.append((len(b.seq_lens), size))
        return size

    graphs.size_for = counted
    return replays
