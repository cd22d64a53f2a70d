"""Executors: own the workers, run a step on all of them, return the driver's tokens."""

from __future__ import annotations

from pyengine.config import EngineConfig
from pyengine.executor.abstract import Executor, ExecutorDeadError
from pyengine.executor.uniproc import UniProcExecutor
from pyengine.loader.resolve import LoadedModel

__all__ = ["Executor", "ExecutorDeadError", "UniProcExecutor", "create_executor"]


def create_executor(loaded: LoadedModel, config: EngineConfig) -> Executor:
    """The executor config.parallel names (its backend's module imported only then)."""
    backend = config.parallel.distributed_executor_backend
    if backend == "mp":
        from pyengine.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(loaded, config)
    if backend == "ray":
        from pyengine.executor.ray_distributed import RayDistributedExecutor

        ray_executor: Executor = RayDistributedExecutor(loaded, config)
        return ray_executor
    return UniProcExecutor(loaded, config)
