"""The Executor seam: the engine hands it a step and gets sampled tokens back, whether
its workers run in this process, in one process per rank or across machines."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

from pyengine.step_values import ModelRunnerOutput, SchedulerOutput


class ExecutorDeadError(RuntimeError):
    """A worker died or stopped answering: the executor runs no more steps."""


class Executor(ABC):
    # Steps the engine may submit before collecting the first: the pipeline's stages
    # (one step each at a time), 1 without a pipeline.
    max_steps_in_flight: int = 1

    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """KV-cache blocks every worker holds (the schedulers' pool, shared between the
        steps in flight)."""

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the KV cache's host tier every worker holds (0: none)."""
        return 0

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

    @property
    def is_alive(self) -> bool:
        """False once a worker has died or stopped answering (ExecutorDeadError)."""
        return True

    def check_health(self) -> bool:
        """Whether every worker is there now (for /health: between steps too, a worker
        that died is noticed); one that is gone ends the executor."""
        return self.is_alive

    # Whether steps run in the engine's own process (a step may then carry what cannot
    # be sent to another: SchedulerOutput.masks_pending).
    in_process = False

    def submit(self, step: SchedulerOutput) -> None:
        """Starts `step`; collect() returns its tokens, in submission order. Here it runs
        at once (an executor whose workers run on their own overrides both)."""
        if not hasattr(self, "_results"):
            self._results: deque[ModelRunnerOutput] = deque()
        self._results.append(self.execute_model(step))

    def collect(self) -> ModelRunnerOutput:
        """The tokens of the oldest step submitted and not yet collected."""
        return self._results.popleft()
