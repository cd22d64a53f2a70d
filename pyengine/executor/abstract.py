"""The Executor seam: the engine hands it a step and gets its tokens back, whether its
workers run in this process, in one process per rank or across machines. A step goes
one way, in the same calls everywhere: execute_model (the forward pass), sample_tokens
(with the engine's grammar masks), and redraw where a grammar refused a checked row's
token. Each call returns a Pending whose result() waits for the output rank's answer
(an in-process worker has run the call already; workers elsewhere answer later); with a
pipeline, the calls of several steps are in flight."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from pyengine.step_values import ExecuteOutput, GrammarMasks, SampledTokens, SchedulerOutput

T = TypeVar("T")


class ExecutorDeadError(RuntimeError):
    """A worker died or stopped answering: the executor runs no more steps."""


class Pending(ABC, Generic[T]):
    """The answer of a call to the workers, once it has come."""

    @abstractmethod
    def result(self) -> T:
        """The output rank's answer (waiting for it); the call's error where it failed."""

    def abandon(self) -> None:
        """The answer will not be asked for (its step failed): it is dropped once it
        comes, so that nothing holds it."""


@dataclass
class Done(Pending[T]):
    """An answer already there: a call an in-process worker ran."""

    value: T

    def result(self) -> T:
        return self.value


class Executor(ABC):
    # Steps the engine may have in flight at once: the pipeline's stages (one step each
    # at a time), 1 without a pipeline.
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
    def num_state_slots(self) -> int:
        """Recurrent-state slots of each scheduler (a hybrid model's; 0: none)."""
        return 0

    @property
    def num_state_checkpoints(self) -> int:
        """Slots of each scheduler's recurrent-state checkpoints (prefix caching with a
        hybrid model; 0: none)."""
        return 0

    @property
    @abstractmethod
    def kv_groups(self) -> tuple[tuple[str, int], ...]:
        """The KV-cache groups of the model the workers run (worker/kv_layout.py), as
        the schedulers' KV-cache managers take them."""

    @property
    @abstractmethod
    def num_parameters(self) -> int:
        """Parameters of the model the workers run (all shards; a tied head once)."""

    @abstractmethod
    def execute_model(self, step: SchedulerOutput) -> Pending[ExecuteOutput]:
        """Runs `step`'s forward pass on every worker; its drafts (a draft model's) and
        prompt logprobs. The workers keep its logits for sample_tokens."""

    @abstractmethod
    def sample_tokens(
        self, virtual_engine: int, masks: GrammarMasks | None
    ) -> Pending[SampledTokens]:
        """The tokens of the step virtual_engine executed last, under `masks`."""

    @abstractmethod
    def redraw(
        self, virtual_engine: int, rows: list[int], masks: np.ndarray
    ) -> Pending[SampledTokens]:
        """The tokens of checked `rows` of the step virtual_engine sampled last drawn
        again under `masks` (the rows whose grammars refused their first draw)."""

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
