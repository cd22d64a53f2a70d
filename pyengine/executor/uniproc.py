"""One worker, in this process: the executor of a single device."""

from __future__ import annotations

from pyengine.config import EngineConfig
from pyengine.executor.abstract import Executor
from pyengine.loader.resolve import LoadedModel
from pyengine.step_values import ModelRunnerOutput, SchedulerOutput
from pyengine.worker.worker import Worker


class UniProcExecutor(Executor):
    in_process = True

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self._closed = False
        self.driver_worker = Worker(loaded, config)
        worker = self.driver_worker
        worker.initialize_cache(worker.num_blocks, num_host_blocks=worker.num_host_blocks)

    @property
    def num_blocks(self) -> int:
        return self.driver_worker.num_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.driver_worker.num_host_blocks

    @property
    def num_parameters(self) -> int:
        return self.driver_worker.model_runner.model.num_parameters

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        out = self.driver_worker.execute_model(step)
        assert out is not None  # the only rank is the output rank
        return out

    @property
    def is_alive(self) -> bool:
        return not self._closed

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.driver_worker.shutdown()
