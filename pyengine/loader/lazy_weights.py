"""A checkpoint's tensors by name, each read from its file when it is asked for: a
model's loaders take one tensor at a time and keep only their rank's shard of it, so no
process ever holds the whole checkpoint at once (nor a rank the shards of the others)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch


class LazyWeights(Mapping[str, torch.Tensor]):
    def __init__(self, readers: dict[str, Callable[[], torch.Tensor]]) -> None:
        self._readers = readers

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._readers[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)
