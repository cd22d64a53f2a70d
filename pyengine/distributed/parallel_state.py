"""A worker's place in its tensor-parallel group.

Passed to every parallel layer when a model is built (no process-wide state), so that
several groups, or none, can live in one process. With world_size 1 every collective is
the identity and no torch.distributed process group is needed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pyengine.sampling_params import is_int


@dataclass
class CommStats:
    """Time spent in collectives and point-to-point transfers, since the last reset: the
    share of a step that communication costs (bench/distributed.py reads it)."""

    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0

    def add(self, started: float, x: torch.Tensor) -> None:
        self.seconds += time.perf_counter() - started
        self.calls += 1
        self.bytes += x.numel() * x.element_size()


@dataclass(frozen=True)
class TensorParallelGroup:
    world_size: int = 1
    rank: int = 0
    # The torch.distributed group of this rank's tensor-parallel peers (None: the
    # default group, or no group at world_size 1).
    group: Any = field(default=None, compare=False)
    comm: CommStats = field(default_factory=CommStats, compare=False)
    # Where the group's ranks share a machine: its collectives of CPU tensors go through
    # shared memory (ShmCommunicator), the rest through torch.distributed.
    local: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not is_int(self.world_size) or self.world_size < 1:
            raise ValueError(f"tensor-parallel world_size must be >= 1, got {self.world_size!r}")
        if not is_int(self.rank) or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"tensor-parallel rank must be in [0, {self.world_size}), got {self.rank!r}"
            )

    def split(self, size: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal part of `size` entries; ValueError naming
        `what` where the parts would not be equal."""
        if size % self.world_size:
            raise ValueError(
                f"{what} ({size}) is not divisible by the tensor-parallel size ({self.world_size})"
            )
        length = size // self.world_size
        return self.rank * length, length

    def kv_head_shard(self, num_kv_heads: int) -> tuple[int, int]:
        """(first kv head, kv heads) this rank holds: an equal part where the heads are at
        least the ranks, else one head shared by world_size / num_kv_heads ranks."""
        if num_kv_heads >= self.world_size:
            return self.split(num_kv_heads, "num_kv_heads")
        if self.world_size % num_kv_heads == 0:
            return self.rank * num_kv_heads // self.world_size, 1
        raise ValueError(
            f"the tensor-parallel size ({self.world_size}) is neither a divisor nor a "
            f"multiple of num_kv_heads ({num_kv_heads})"
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group, in place."""
        if self.world_size > 1:
            started = time.perf_counter()
            if self.local is not None and self.local.fits(x):
                self.local.all_reduce(x)
            else:
                dist.all_reduce(x, group=self.group)
            self.comm.add(started, x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x`, concatenated along `dim` in rank order."""
        if self.world_size == 1:
            return x
        started = time.perf_counter()
        x = x.contiguous()
        if self.local is not None and self.local.fits(x):
            out: torch.Tensor = self.local.all_gather(x, dim)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x, group=self.group)
            out = torch.cat(parts, dim=dim)
        self.comm.add(started, x)
        return out
