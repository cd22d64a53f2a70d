"""One worker, in this process: the executor of a single device."""

from __future__ import annotations

from typing import TypeVar

import numpy as np

from pyengine.config import EngineConfig
from pyengine.executor.abstract import Done, Executor, Pending
from pyengine.loader.resolve import LoadedModel
from pyengine.step_values import ExecuteOutput, GrammarMasks, SampledTokens, SchedulerOutput
from pyengine.worker.worker import Worker

T = TypeVar("T")


class UniProcExecutor(Executor):
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self._closed = False
        self.driver_worker = Worker(loaded, config)
        worker = self.driver_worker
        worker.initialize_cache(worker.num_blocks, num_host_blocks=worker.num_host_blocks)

    @property
    def num_blocks(self) -> int:
        return self.driver_worker.num_blocks

    @property
    def num_state_slots(self) -> int:
        return self.driver_worker.model_runner.num_state_slots

    @property
    def num_state_checkpoints(self) -> int:
        return self.driver_worker.model_runner.num_state_checkpoints

    @property
    def kv_groups(self) -> tuple[tuple[str, int], ...]:
        return self.driver_worker.model_runner.kv_layout.groups

    @property
    def num_host_blocks(self) -> int:
        return self.driver_worker.num_host_blocks

    @property
    def num_parameters(self) -> int:
        return self.driver_worker.model_runner.model.num_parameters

    def execute_model(self, step: SchedulerOutput) -> Pending[ExecuteOutput]:
        return Done(_answer(self.driver_worker.execute_model(step)))

    def sample_tokens(
        self, virtual_engine: int, masks: GrammarMasks | None
    ) -> Pending[SampledTokens]:
        return Done(_answer(self.driver_worker.sample_tokens(virtual_engine, masks)))

    def redraw(
        self, virtual_engine: int, rows: list[int], masks: np.ndarray
    ) -> Pending[SampledTokens]:
        return Done(_answer(self.driver_worker.redraw(virtual_engine, rows, masks)))

    @property
    def is_alive(self) -> bool:
        return not self._closed

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.driver_worker.shutdown()


def _answer(value: T | None) -> T:
    assert value is not None  # the only rank is the output rank
    return value
