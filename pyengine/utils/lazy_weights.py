"""A checkpoint's tensors by name, read when asked for (LazyWeights), and a checkpoint
tensor not read yet (LazySlice): its shape, and the narrowing and transposition a
layer's loader applies, recorded until `materialize` reads just the region they leave.
A model's loaders take one tensor at a time and keep only their rank's shard of it, so
no process holds the whole checkpoint, nor a rank the other ranks' shards."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

# Reads the region (a slice per stored dimension) of the stored tensor.
RegionReader = Callable[[tuple[slice, ...]], torch.Tensor]


class LazySlice:
    def __init__(
        self,
        read: RegionReader,
        stored_shape: tuple[int, ...],
        region: tuple[slice, ...] | None = None,
        transposed: bool = False,
    ) -> None:
        self._read, self._stored_shape = read, stored_shape
        self._region = region or tuple(slice(0, n) for n in stored_shape)
        self._transposed = transposed

    @property
    def shape(self) -> tuple[int, ...]:
        sizes = tuple(r.stop - r.start for r in self._region)
        return sizes[::-1] if self._transposed else sizes

    def dim(self) -> int:
        return len(self._stored_shape)

    def narrow(self, dim: int, start: int, length: int) -> LazySlice:
        stored = (self.dim() - 1 - dim) if self._transposed else dim
        current = self._region[stored]
        if start < 0 or length < 0 or start + length > current.stop - current.start:
            raise IndexError(f"narrow({dim}, {start}, {length}) outside shape {self.shape}")
        region = list(self._region)
        region[stored] = slice(current.start + start, current.start + start + length)
        return LazySlice(self._read, self._stored_shape, tuple(region), self._transposed)

    def t(self) -> LazySlice:
        if self.dim() != 2:
            raise ValueError(f"t() of a {self.dim()}-d tensor")
        return LazySlice(self._read, self._stored_shape, self._region, not self._transposed)

    def read(self) -> torch.Tensor:
        tensor = self._read(self._region)
        return tensor.t() if self._transposed else tensor


# What a layer's weight loader takes: a tensor, or a checkpoint tensor still to be read.
CheckpointTensor = torch.Tensor | LazySlice


def materialize(x: CheckpointTensor) -> torch.Tensor:
    return x.read() if isinstance(x, LazySlice) else x


class LazyWeights(Mapping[str, torch.Tensor]):
    """Tensors by name, each read whole when asked for; `sliced()`: the same names as
    LazySlices, where the format reads regions (safetensors)."""

    def __init__(
        self,
        readers: dict[str, Callable[[], torch.Tensor]],
        slicers: dict[str, Callable[[], LazySlice]] | None = None,
    ) -> None:
        self._readers, self._slicers = readers, slicers

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._readers[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)

    def sliced(self) -> Mapping[str, CheckpointTensor]:
        if self._slicers is None:
            return self
        return {name: slicer() for name, slicer in self._slicers.items()}
