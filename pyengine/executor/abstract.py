"""The Executor seam: the engine hands it a step and gets sampled tokens back, whether
its workers run in this process, in one process per rank or across machines."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pyengine.worker.scheduler_output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """KV-cache blocks every worker holds (the scheduler's pool)."""

    @property
    @abstractmethod
    def num_parameters(self) -> int:
        """Parameters of the model the workers run (all shards; a tied head once)."""

    @abstractmethod
    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Runs `step` on every worker; the sampled tokens (the same on every rank)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Releases the workers (processes, devices); the executor runs no more steps."""
