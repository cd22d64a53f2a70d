"""Executors: own the workers, run a step on all of them, return the driver's tokens."""

from __future__ import annotations

from pyengine.executor.abstract import Executor, ExecutorDeadError
from pyengine.executor.registry import EXECUTORS, create_executor, executor_names
from pyengine.executor.uniproc import UniProcExecutor

__all__ = [
    "EXECUTORS",
    "Executor",
    "ExecutorDeadError",
    "UniProcExecutor",
    "create_executor",
    "executor_names",
]
