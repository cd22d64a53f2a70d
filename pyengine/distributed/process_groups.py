"""The torch.distributed groups of a tensor- and pipeline-parallel run.

Global rank r is tensor-parallel rank r % tp of pipeline stage r // tp (as vLLM lays
them out): a stage's ranks are neighbours, on one machine where the nodes allow.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from pyengine.distributed.parallel_state import TensorParallelGroup
from pyengine.distributed.pipeline import PipelineStage
from pyengine.distributed.shm_communicator import ShmCommunicator


def parallel_place(
    rank: int, tensor_parallel_size: int, pipeline_parallel_size: int
) -> tuple[TensorParallelGroup, PipelineStage]:
    """Rank `rank`'s places, without process groups (the layout alone)."""
    tp_rank, pp_rank = rank % tensor_parallel_size, rank // tensor_parallel_size
    tp = TensorParallelGroup(tensor_parallel_size, tp_rank)
    prev_rank = rank - tensor_parallel_size if pp_rank > 0 else None
    next_rank = rank + tensor_parallel_size if pp_rank < pipeline_parallel_size - 1 else None
    return tp, PipelineStage(pipeline_parallel_size, pp_rank, prev_rank, next_rank)


def init_process_groups(
    rank: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    backend: str,
    init_method: str,
    timeout_s: float,
    shm_slot_bytes: int = 0,
) -> tuple[TensorParallelGroup, PipelineStage]:
    """Joins the run's default group (every rank) and makes each stage's
    tensor-parallel group; returns this rank's places in them. `shm_slot_bytes`: the
    largest tensor a gloo group whose ranks share a machine exchanges through shared
    memory (0: none)."""
    world_size = tensor_parallel_size * pipeline_parallel_size
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip
    tp, pp = parallel_place(rank, tensor_parallel_size, pipeline_parallel_size)
    group = None
    for stage in range(pipeline_parallel_size):  # every rank makes every group, in order
        ranks = list(range(stage * tensor_parallel_size, (stage + 1) * tensor_parallel_size))
        made = dist.new_group(ranks) if pipeline_parallel_size > 1 else dist.group.WORLD
        if stage == pp.rank:
            group = made
    local = None
    if tensor_parallel_size > 1 and backend == "gloo" and shm_slot_bytes > 0:
        local = _shm_communicator(tp, group, pp.rank * tensor_parallel_size, shm_slot_bytes,
                                  timeout_s)  # fmt: skip
    return TensorParallelGroup(tp.world_size, tp.rank, group, local=local), pp


def _shm_communicator(
    tp: TensorParallelGroup, group: Any, first_rank: int, slot_bytes: int, timeout_s: float
) -> ShmCommunicator | None:
    """The group's shared-memory communicator where all its ranks are on this machine
    (None elsewhere): its first rank makes the file, every rank maps it, then it is
    unlinked."""
    hosts: list[object] = [None] * tp.world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        return None
    path = [ShmCommunicator.create(tp.world_size, slot_bytes) if tp.rank == 0 else None]
    dist.broadcast_object_list(path, src=first_rank, group=group)
    assert isinstance(path[0], str)
    try:
        communicator = ShmCommunicator(path[0], tp.rank, tp.world_size, slot_bytes, timeout_s)
        dist.barrier(group=group)  # every rank has it mapped
    finally:
        if tp.rank == 0:  # also where a peer never came: no file is left behind
            os.unlink(path[0])
    return communicator


def destroy_process_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
