"""What the executors with a worker per rank share: starting the ranks, settling the KV
cache on the least any rank holds, running steps (several in flight with a pipeline),
telling the engine which rank failed, and failing fast once one is gone.

A subclass moves the commands: `_send` one to every rank, `_receive` every rank's
answer to the oldest command still unanswered, `_kill` the ranks.
"""

from __future__ import annotations

import logging
import os
from abc import abstractmethod
from typing import Any, TypeVar

import numpy as np

from pyengine.config import EngineConfig
from pyengine.executor.abstract import Executor, ExecutorDeadError, Pending
from pyengine.executor.numbered_replies import NumberedReplies, Reply
from pyengine.executor.worker_process import WorkerSpec
from pyengine.faults import RequestFault
from pyengine.loader.resolve import LoadedModel
from pyengine.step_values import ExecuteOutput, GrammarMasks, SampledTokens, SchedulerOutput

T = TypeVar("T")

logger = logging.getLogger("pyengine")


def step_timeout_s() -> float:
    """Seconds a rank may take to answer a step before it counts as gone:
    PYENGINE_STEP_TIMEOUT_S, default 600 (a long prefill on a CPU takes seconds)."""
    value = os.environ.get("PYENGINE_STEP_TIMEOUT_S", "600")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"PYENGINE_STEP_TIMEOUT_S must be a number, got {value!r}") from None
    if seconds <= 0:
        raise ValueError(f"PYENGINE_STEP_TIMEOUT_S must be positive, got {value!r}")
    return seconds


class DistributedExecutor(Executor):
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        parallel = config.parallel
        parallel.check_model(loaded.config)
        if loaded.spec is None:
            raise ValueError("a distributed executor needs a model its workers can load")
        self.config = config
        self.world_size = parallel.world_size
        self.max_steps_in_flight = parallel.pipeline_parallel_size
        # The output rank: tensor-parallel rank 0 of the last stage.
        self.output_rank = self.world_size - parallel.tensor_parallel_size
        self.timeout_s = step_timeout_s()
        self._dead: str | None = None
        # Commands are numbered as sent; their answers come in that order, and those
        # received before their caller asks wait here (a pipeline's steps overlap).
        self._replies_book = NumberedReplies(lambda: self._receive(self.timeout_s))
        self._closed = False
        spec = WorkerSpec(loaded.spec, config, "", self.timeout_s)
        try:
            descriptions = self._start(spec)
            self.ranks = sorted(descriptions, key=lambda d: d["rank"])
            self._num_blocks = min(int(d["num_blocks"]) for d in self.ranks)
            self._num_host_blocks = min(int(d["num_host_blocks"]) for d in self.ranks)
            self._call(("init_cache", self._num_blocks, self.max_steps_in_flight,
                        self._num_host_blocks))  # fmt: skip
        except BaseException:
            self._dead = self._dead or "a worker failed to start"
            self.shutdown()
            raise
        self._log_ranks()

    # -- what a transport provides -------------------------------------------------

    @abstractmethod
    def _start(self, spec: WorkerSpec) -> list[dict[str, Any]]:
        """Starts every rank (`spec` with the rendezvous address the ranks meet at);
        their describe() once all are ready (an error naming the rank that failed
        otherwise)."""

    @abstractmethod
    def _send(self, command: tuple[Any, ...]) -> None: ...

    @abstractmethod
    def _receive(self, timeout_s: float) -> list[Reply]:
        """Every rank's reply to the oldest unanswered command, in rank order;
        ExecutorDeadError (via _die) where a rank is gone or does not answer in time."""

    @abstractmethod
    def _kill(self) -> None:
        """Ends every rank now, and frees what the transport holds."""

    @abstractmethod
    def _stop(self) -> None:
        """Asks every rank to end (after "shutdown"), ending those that do not."""

    # -- the executor --------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_state_slots(self) -> int:
        return self._same_on_every_rank("num_state_slots")

    @property
    def num_state_checkpoints(self) -> int:
        return self._same_on_every_rank("num_state_checkpoints")

    def _same_on_every_rank(self, key: str) -> int:
        values = {int(d[key]) for d in self.ranks}
        if len(values) > 1:  # (each rank's budget holds the same on the CPU)
            raise RuntimeError(f"the ranks hold different {key}: {values}")
        return values.pop()

    @property
    def kv_groups(self) -> tuple[tuple[str, int], ...]:
        return tuple((str(kind), int(size)) for kind, size in self.ranks[0]["kv_groups"])

    @property
    def num_host_blocks(self) -> int:
        return self._num_host_blocks

    @property
    def num_parameters(self) -> int:
        """Over every rank's shard (what is replicated, norms, counted on each rank)."""
        return sum(int(d["num_parameters"]) for d in self.ranks)

    @property
    def is_alive(self) -> bool:
        return self._dead is None and not self._closed

    def execute_model(self, step: SchedulerOutput) -> Pending[ExecuteOutput]:
        return _Answer(self, self._send_numbered(("execute", step)))

    def sample_tokens(
        self, virtual_engine: int, masks: GrammarMasks | None
    ) -> Pending[SampledTokens]:
        return _Answer(self, self._send_numbered(("sample", virtual_engine, masks)))

    def redraw(
        self, virtual_engine: int, rows: list[int], masks: np.ndarray
    ) -> Pending[SampledTokens]:
        return _Answer(self, self._send_numbered(("redraw", virtual_engine, rows, masks)))

    def collective_rpc(self, command: tuple[Any, ...]) -> list[Any]:
        """Every rank's result of `command` (between steps: none may be in flight)."""
        if not self._replies_book.is_idle():
            raise RuntimeError("collective_rpc with steps in flight")
        return self._call(command)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._dead is None:
                self._stop()
        finally:
            self._kill()

    # -- helpers -------------------------------------------------------------------

    def _call(self, command: tuple[Any, ...]) -> list[Any]:
        return self._answers(self._replies(self._send_numbered(command)))

    def _send_numbered(self, command: tuple[Any, ...]) -> int:
        """Sends `command` to every rank; its number, for _replies."""
        self._check_alive()
        self._send(command)
        return self._replies_book.sent()

    def _replies(self, number: int) -> list[Reply]:
        """Every rank's reply to command `number` (receiving those before it)."""
        self._check_alive()
        return self._replies_book.replies(number)

    def abandon(self, number: int) -> None:
        """Command `number`'s answer will not be asked for: dropped now, or on arrival."""
        self._replies_book.abandon(number)

    def output_answer(self, number: int) -> Any:
        """The output rank's answer to command `number`; the error of a rank that
        failed it."""
        return self._answers(self._replies(number))[self.output_rank]

    def _answers(self, replies: list[Reply]) -> list[Any]:
        failed = [(rank, value) for rank, (kind, value) in enumerate(replies) if kind == "error"]
        faults = [value for _, value in failed if isinstance(value, RequestFault)]
        if faults:
            raise faults[0]  # (the step's requests at fault: the engine retries without them)
        if failed:
            rank, text = failed[0]
            raise RuntimeError(
                f"worker rank {rank} failed: {text.strip().splitlines()[-1]}\n{text}"
            )
        return [value for _, value in replies]

    def _check_alive(self) -> None:
        if self._closed:
            raise ExecutorDeadError("the executor has been shut down")
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)

    def _die(self, reason: str) -> ExecutorDeadError:
        """Marks the executor dead (every rank ended); the error to raise."""
        if self._dead is None:
            self._dead = reason
            logger.error("distributed executor: %s; ending every worker", reason)
            self._kill()
        return ExecutorDeadError(reason)

    def _log_ranks(self) -> None:
        for d in self.ranks:
            start, end = d["layers"]
            logger.info(
                "rank %d (pid %s%s): stage %d layers %d-%d, tensor-parallel rank %d with %d "
                "kv heads; weights %.1f MiB, KV cache %d blocks (%.1f MiB)",
                d["rank"], d["pid"], f" on {d['node']}" if "node" in d else "", d["pp_rank"],
                start, end - 1, d["tp_rank"], d["kv_heads"],
                d["weight_bytes"] / 2**20, self._num_blocks,
                self._num_blocks * d["block_bytes"] / 2**20,
            )  # fmt: skip


class _Answer(Pending[T]):
    """The output rank's answer to a numbered command, once received."""

    def __init__(self, executor: DistributedExecutor, number: int) -> None:
        self.executor = executor
        self.number = number

    def result(self) -> T:
        answer: T = self.executor.output_answer(self.number)
        return answer

    def abandon(self) -> None:
        self.executor.abandon(self.number)
