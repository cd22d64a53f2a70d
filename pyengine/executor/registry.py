"""The executors by name (ParallelConfig.distributed_executor_backend), each imported only
when an engine chooses it (Ray is an optional dependency): adding one is its module and
a line here. The CLI's choices and EngineArgs' checks read EXECUTORS."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyengine.config import EngineConfig, ParallelConfig
    from pyengine.executor.abstract import Executor
    from pyengine.loader.resolve import LoadedModel


@dataclass(frozen=True)
class ExecutorEntry:
    """Where an executor's class is, how many ranks it runs (None: any), and whether its
    workers run in the engine's process (which then reads the weights for them; workers
    of their own read their shards themselves)."""

    module: str
    class_name: str
    max_ranks: int | None = None
    in_this_process: bool = False


EXECUTORS: dict[str, ExecutorEntry] = {
    # one rank, in this process
    "uni": ExecutorEntry("pyengine.executor.uniproc", "UniProcExecutor", 1, True),
    # a process per rank on this machine
    "mp": ExecutorEntry("pyengine.executor.multiproc", "MultiprocExecutor"),
    # Ray actors across a cluster's nodes
    "ray": ExecutorEntry("pyengine.executor.ray_distributed", "RayDistributedExecutor"),
}


def executor_names() -> list[str]:
    """The executors' names, as the CLI offers them."""
    return list(EXECUTORS)


def check_executor(parallel: ParallelConfig) -> None:
    """ValueError where the parallel config names no executor, or one that cannot run its
    ranks."""
    name = parallel.distributed_executor_backend
    entry = EXECUTORS.get(name)
    if entry is None:
        raise ValueError(
            f"distributed_executor_backend must be one of {', '.join(EXECUTORS)}, got {name!r}"
        )
    if entry.max_ranks is not None and parallel.world_size > entry.max_ranks:
        most = "one rank" if entry.max_ranks == 1 else f"at most {entry.max_ranks} ranks"
        others = [repr(n) for n, e in EXECUTORS.items() if e.max_ranks is None]
        raise ValueError(
            f"distributed_executor_backend {name!r} runs {most}; {parallel.world_size} "
            f"(tensor_parallel_size x pipeline_parallel_size) need {' or '.join(others)}"
        )


def runs_in_this_process(parallel: ParallelConfig) -> bool:
    """Whether the executor's workers run in the engine's process."""
    return EXECUTORS[parallel.distributed_executor_backend].in_this_process


def executor_class(name: str) -> Callable[[LoadedModel, EngineConfig], Executor]:
    """The executor named `name` (its class: made of the model and the config), its
    module imported now."""
    entry = EXECUTORS[name]
    cls: Callable[[LoadedModel, EngineConfig], Executor] = getattr(
        importlib.import_module(entry.module), entry.class_name
    )
    return cls


def create_executor(loaded: LoadedModel, config: EngineConfig) -> Executor:
    """The executor config.parallel names (its module imported only then)."""
    check_executor(config.parallel)
    return executor_class(config.parallel.distributed_executor_backend)(loaded, config)
