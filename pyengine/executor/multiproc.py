"""The `mp` executor: a spawned process per rank on this machine. Commands go to every
rank through one shared-memory broadcast (ShmBroadcast: pickled once per step); each
rank answers through its own pipe. A rank that dies, or does not answer within the step
timeout, ends them all: nothing is left running, and the engine is told.

Each rank gets an equal share of this machine's cores for its threads (OMP_NUM_THREADS,
as the process starts); on CUDA, rank r runs on GPU r.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import types
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from pyengine.config import EngineConfig
from pyengine.executor.distributed import DistributedExecutor
from pyengine.executor.numbered_replies import Reply
from pyengine.executor.shm_broadcast import ShmBroadcast
from pyengine.executor.worker_process import WorkerSpec, free_port, run_worker_process
from pyengine.loader.resolve import LoadedModel

# Bytes of a broadcast slot: a step's arrays for thousands of tokens and their sampling
# requests; a larger step goes through the pipes (ShmBroadcast).
SLOT_BYTES = 4 << 20
STARTUP_TIMEOUT_S = 600.0  # to load a model's shards and join the group
STOP_TIMEOUT_S = 10.0  # for a rank to end after "shutdown"


def threads_per_rank(world_size: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world_size)


class MultiprocExecutor(DistributedExecutor):
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        world = config.parallel.world_size
        if config.device.startswith("cuda") and torch.cuda.device_count() < world:
            raise ValueError(
                f"{world} ranks need a GPU each, and this machine has "
                f"{torch.cuda.device_count()} (or use the ray backend across machines)"
            )
        self.processes: list[BaseProcess] = []
        self.pipes: list[Connection] = []
        self.broadcast: ShmBroadcast | None = None
        self._sent: deque[int] = deque([0])  # numbers of the commands still unanswered
        super().__init__(loaded, config)

    def _start(self, spec: WorkerSpec) -> list[dict[str, Any]]:
        spec = replace(spec, init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}")
        context = mp.get_context("spawn")  # never fork: torch's threads and CUDA
        n = self.world_size
        pairs = [context.Pipe(duplex=True) for _ in range(n)]
        wakeups = [context.Semaphore(0) for _ in range(n)]
        self.pipes = [driver for driver, _ in pairs]
        slots = 3 * self.max_steps_in_flight + 2  # (a step's execute, sample and redraw)
        self.broadcast = ShmBroadcast(n, slots, SLOT_BYTES, wakeups, self.pipes)
        layout = (self.broadcast.name, n, slots, SLOT_BYTES)
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(n))
        try:
            with _without_main_module():
                for rank in range(n):
                    process = context.Process(
                        target=run_worker_process,
                        args=(spec, rank, layout, wakeups[rank], pairs[rank][1], os.getpid()),
                        name=f"pyengine-rank{rank}",
                        daemon=True,  # ended with this process, whatever ends it
                    )
                    process.start()
                    self.processes.append(process)
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        for _, child in pairs:
            child.close()  # the children hold theirs: a dead child's pipe reads EOF
        # Should this process end without shutdown(), its ranks and memory go with it.
        weakref.finalize(self, _end_processes, self.processes, self.broadcast)
        replies = self._receive(STARTUP_TIMEOUT_S, expect="ready")
        return [value for _, value in replies]

    def _send(self, command: tuple[Any, ...]) -> None:
        assert self.broadcast is not None
        self.broadcast.write(command, lambda: all(p.is_alive() for p in self.processes))
        self._sent.append(self.broadcast.sequence)

    def _receive(self, timeout_s: float, expect: str = "ok") -> list[Reply]:
        replies: dict[int, Reply] = {}
        number = self._sent.popleft()
        deadline = time.monotonic() + timeout_s
        rank_of = {id(pipe): rank for rank, pipe in enumerate(self.pipes)}
        rank_of_sentinel: dict[Any, int] = {
            p.sentinel: rank for rank, p in enumerate(self.processes)
        }
        while len(replies) < self.world_size:
            waiting = [self.pipes[r] for r in range(self.world_size) if r not in replies]
            remaining = deadline - time.monotonic()
            ready = wait([*waiting, *rank_of_sentinel], timeout=max(remaining, 0))
            pipes = [r for r in ready if isinstance(r, Connection)]
            for pipe in pipes:
                rank = rank_of[id(pipe)]
                try:
                    answered, kind, value = pipe.recv()
                except (EOFError, OSError):
                    raise self._die(self._gone(rank)) from None
                if answered < number:
                    continue  # a command whose waiter was interrupted: nobody wants it
                if kind == "error" and expect == "ready":
                    raise RuntimeError(f"worker rank {rank} failed to start:\n{value}")
                replies[rank] = (kind if kind != "ready" else "ok", value)
                if kind == "error":  # its peers may wait on it in a collective
                    deadline = min(deadline, time.monotonic() + STOP_TIMEOUT_S)
            if not pipes:
                dead = [rank_of_sentinel[s] for s in ready if not isinstance(s, Connection)]
                if dead:
                    raise self._die(self._gone(dead[0]))
                if time.monotonic() >= deadline:
                    late = sorted(set(range(self.world_size)) - set(replies))
                    raise self._die(f"worker ranks {late} did not answer within {timeout_s:.0f} s")
        return [replies[r] for r in range(self.world_size)]

    def check_health(self) -> bool:
        if self.is_alive:
            dead = [rank for rank, p in enumerate(self.processes) if not p.is_alive()]
            if dead:
                self._die(self._gone(dead[0]))
        return self.is_alive

    def _gone(self, rank: int) -> str:
        process = self.processes[rank]
        process.join(0.1)
        code = process.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"worker rank {rank} (pid {process.pid}) died ({how})"

    def _stop(self) -> None:
        if self.broadcast is None or not all(p.is_alive() for p in self.processes):
            return
        try:
            self._send(("shutdown",))
        except RuntimeError:
            return
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes:
            process.join(max(deadline - time.monotonic(), 0))

    def _kill(self) -> None:
        _end_processes(self.processes, self.broadcast)


@contextmanager
def _without_main_module() -> Iterator[None]:
    """Spawned children re-run the parent's main script unless it is guarded by
    `if __name__ == "__main__"`; the ranks need nothing of it (their code is pyengine's),
    so they are started as if there were none, and any script may build an engine."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _end_processes(processes: list[BaseProcess], broadcast: ShmBroadcast | None) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(5)
    if broadcast is not None:
        broadcast.close()
