"""A worker's place in the pipeline: which of the model's layers its stage holds, and the
transfers of hidden states (and the residual) from stage to stage.

Each rank of a stage sends to the rank of the same tensor-parallel rank in the next
stage: the hidden states are replicated over a stage's tensor-parallel ranks (the
row-parallel layers end in an all-reduce), so each pair carries a whole copy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pyengine.distributed.parallel_state import CommStats
from pyengine.sampling_params import is_int

# What a stage hands the next: named [num_tokens, hidden] tensors ("hidden", and for
# models with a separate residual stream, "residual").
IntermediateTensors = dict[str, torch.Tensor]


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers: equal parts, the remainder one layer each to
    the stages before the last (the last also runs the final norm and the LM head)."""
    if num_layers < num_stages:
        raise ValueError(
            f"the model's {num_layers} layers cannot be split into {num_stages} pipeline "
            "stages (each stage needs at least one layer)"
        )
    sizes = [num_layers // num_stages] * num_stages
    for i in range(num_layers % num_stages):
        sizes[-2 - i] += 1
    starts = [sum(sizes[:i]) for i in range(num_stages)]
    return [(start, start + size) for start, size in zip(starts, sizes, strict=True)]


@dataclass(frozen=True)
class PipelineStage:
    world_size: int = 1  # stages
    rank: int = 0  # this stage
    prev_rank: int | None = None  # global rank this rank receives from (None: the first)
    next_rank: int | None = None  # global rank it sends to (None: the last stage)
    comm: CommStats = field(default_factory=CommStats, compare=False)
    # Sends still in flight (isend): kept until the next send, so a stage starts its next
    # step while the previous step's hidden states travel.
    _pending: list[Any] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not is_int(self.world_size) or self.world_size < 1:
            raise ValueError(f"pipeline world_size must be >= 1, got {self.world_size!r}")
        if not is_int(self.rank) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"pipeline rank must be in [0, {self.world_size}), got {self.rank!r}")

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of the layers this stage holds."""
        return stage_layer_ranges(num_layers, self.world_size)[self.rank]

    def send(self, tensors: IntermediateTensors) -> None:
        """Sends this stage's output to the next stage (returns once the sends are
        posted; the tensors must not change until the next send)."""
        if self.next_rank is None:
            raise RuntimeError("the last pipeline stage has no next stage to send to")
        started = time.perf_counter()
        for work in self._pending:
            work.wait()
        self._pending.clear()
        for name in sorted(tensors):
            x = tensors[name].contiguous()
            self._pending.append(dist.isend(x, self.next_rank))
            self.comm.add(started, x)
            started = time.perf_counter()

    def recv(
        self, names: tuple[str, ...], shape: tuple[int, ...], dtype: torch.dtype,
        device: torch.device,
    ) -> IntermediateTensors:  # fmt: skip
        """The previous stage's output: tensors `names`, each of `shape`."""
        if self.prev_rank is None:
            raise RuntimeError("the first pipeline stage has no previous stage to receive from")
        received = {}
        for name in sorted(names):
            started = time.perf_counter()
            x = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(x, self.prev_rank)
            self.comm.add(started, x)
            received[name] = x
        return received
