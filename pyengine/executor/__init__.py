"""Executors: own the workers, run a step on all of them, return the driver's tokens."""

from pyengine.executor.abstract import Executor
from pyengine.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
