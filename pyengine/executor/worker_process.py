"""The loop a worker process runs, for the `mp` executor (a process per rank on this
machine) and the `ray` executor (an actor per rank, which runs the same commands).

Commands reach every rank in the same order; each rank answers each command on its
own channel: ("ok", result) or ("error", the traceback's text) (through a `mp` pipe,
with the command's number first). A step is three commands at most, "execute", "sample"
and "redraw" (Worker's calls of those names); the output rank's results are their values,
the others' None.
"""

from __future__ import annotations

import os
import socket
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Semaphore
from typing import Any

import torch

from pyengine.config import EngineConfig
from pyengine.distributed.process_groups import destroy_process_groups, init_process_groups
from pyengine.faults import RequestFault
from pyengine.loader.resolve import LoadSpec, load_model
from pyengine.worker.worker import Worker


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank is started with."""

    load: LoadSpec
    config: EngineConfig
    init_method: str  # of the torch.distributed rendezvous (tcp://host:port)
    timeout_s: float  # of the collectives: a peer that never comes is an error


class RankWorker:
    """A rank's Worker in its group, and the commands it takes."""

    def __init__(self, spec: WorkerSpec, rank: int, local_rank: int) -> None:
        config, parallel = spec.config, spec.config.parallel
        device = config.device
        if device.startswith("cuda"):
            device = f"cuda:{local_rank}"  # a GPU per rank of this node
            torch.cuda.set_device(device)
        backend = "nccl" if device.startswith("cuda") else "gloo"
        self.rank = rank
        load = spec.load
        loaded = load_model(  # the config; the weights are read as the model is built
            load.model, None, load.load_format, load.keep_block_quantized, read_tokenizer=False
        )
        self.tp, self.pp = init_process_groups(
            rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
            backend, spec.init_method, spec.timeout_s,
            shm_slot_bytes=shm_slot_bytes(config, loaded.config.hidden_size,
                                          loaded.config.vocab_size),
        )  # fmt: skip
        self.worker = Worker(loaded, replace(config, device=device), self.tp, self.pp)

    def describe(self) -> dict[str, Any]:
        """What the driver logs and plans with: this rank's place, layers, heads and
        memory (Worker.describe)."""
        return {
            "rank": self.rank, "pid": os.getpid(), "tp_rank": self.tp.rank,
            "pp_rank": self.pp.rank, **self.worker.describe(),
        }  # fmt: skip

    def run(self, command: tuple[Any, ...]) -> Any:
        kind = command[0]
        if kind == "execute":
            return self.worker.execute_model(command[1])
        if kind == "sample":
            return self.worker.sample_tokens(*command[1:])
        if kind == "redraw":
            return self.worker.redraw(*command[1:])
        if kind == "init_cache":
            self.worker.initialize_cache(*command[1:])
            return None
        if kind == "comm_stats":  # and reset them
            stats = {"tp": self.tp.comm, "pp": self.pp.comm}
            result = {k: (v.seconds, v.calls, v.bytes) for k, v in stats.items()}
            for v in stats.values():
                v.seconds, v.calls, v.bytes = 0.0, 0, 0
            return result
        raise ValueError(f"unknown worker command {kind!r}")

    def answer(self, command: tuple[Any, ...]) -> tuple[str, Any]:
        """("ok", run(command)), or ("error", the traceback's text; a RequestFault
        itself, which the driver raises again): the rank stays up."""
        try:
            return "ok", self.run(command)
        except RequestFault as fault:
            return "error", fault
        except Exception as error:
            return "error", error_text(error)

    def close(self) -> None:
        self.worker.shutdown()
        destroy_process_groups()


MAX_SHM_SLOT_BYTES = 64 << 20


def shm_slot_bytes(config: EngineConfig, hidden_size: int, vocab_size: int) -> int:
    """The largest collective of a step: a step's hidden states (all-reduced), or its
    logits' vocabulary shards (gathered), in float32; capped (a larger one takes gloo)."""
    tp = config.parallel.tensor_parallel_size
    largest = max(
        config.max_num_batched_tokens * hidden_size, config.max_num_seqs * -(-vocab_size // tp)
    )
    return min(4 * largest, MAX_SHM_SLOT_BYTES)


def free_port(host: str) -> int:
    """A TCP port free on `host` now (the rendezvous of a group rank 0 starts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def error_text(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


def run_worker_process(
    spec: WorkerSpec,
    rank: int,
    broadcast: tuple[str, int, int, int],
    wakeup: Semaphore,
    pipe: Connection,
    parent_pid: int,
) -> None:
    """A `mp` worker's process: joins the group, builds its rank, answers (0, "ready",
    describe()) or (0, "error", text), then serves the broadcast's commands until
    "shutdown", or until the driver is gone (its process ended: nothing is left
    behind)."""
    from pyengine.executor.shm_broadcast import ShmReader

    def driver_alive() -> bool:
        return os.getppid() == parent_pid

    try:
        worker = RankWorker(spec, rank, rank)
    except BaseException as error:
        pipe.send((0, "error", error_text(error)))
        return
    name, num_readers, num_slots, slot_bytes = broadcast
    reader = ShmReader(name, rank, num_readers, num_slots, slot_bytes, wakeup, pipe)
    pipe.send((0, "ready", worker.describe()))
    try:
        while True:
            try:
                command = reader.read(driver_alive)
            except RuntimeError:
                return  # the driver is gone
            if command[0] == "shutdown":
                return
            kind, result = worker.answer(command)
            # With the command's number: a driver interrupted while it waited skips the
            # answers it no longer wants.
            pipe.send((reader.sequence, kind, result))
    finally:
        reader.close()
        worker.close()
