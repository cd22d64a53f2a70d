"""The torch.distributed groups of a tensor- and pipeline-parallel run.

Global rank r is tensor-parallel rank r % tp of pipeline stage r // tp (as vLLM lays
them out): a stage's ranks are neighbours, on one machine where the nodes allow.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from pyengine.distributed.parallel_state import TensorParallelGroup
from pyengine.distributed.pipeline import PipelineStage


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
) -> tuple[TensorParallelGroup, PipelineStage]:
    """Joins the run's default group (every rank) and makes each stage's
    tensor-parallel group; returns this rank's places in them."""
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
    return TensorParallelGroup(tp.world_size, tp.rank, group), pp


def destroy_process_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
