"""The `ray` executor: a Ray actor per rank, placed by a placement group over the nodes
of a running Ray cluster (`ray start --head` on one machine, `ray start --address=...`
on the others; without one, Ray starts a local cluster). The driver, this process, runs
the scheduler: each step is put in Ray's object store once and every actor reads it;
Ray runs an actor's calls in the order the driver made them, so the ranks take the steps
in order, as the `mp` executor's broadcast gives them.

A rank whose actor dies (its process killed, its node gone) or that does not answer in
time ends them all. The actors belong to this process: Ray ends them with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import deque
from dataclasses import replace
from typing import Any

from pyengine.config import EngineConfig
from pyengine.executor.distributed import DistributedExecutor
from pyengine.executor.numbered_replies import Reply
from pyengine.executor.worker_process import RankWorker, WorkerSpec, error_text, free_port
from pyengine.loader.resolve import LoadedModel

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as error:  # an optional dependency
    raise ValueError(
        "distributed_executor_backend 'ray' needs Ray, which is not installed: "
        "pip install 'pyengine[ray]'"
    ) from error

logger = logging.getLogger("pyengine")

PLACEMENT_TIMEOUT_S = 60.0  # for the cluster to find every rank its resources
STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0


class RankActor:
    """A rank in a Ray worker process (made a Ray actor class below)."""

    def __init__(self) -> None:
        self.worker: RankWorker | None = None

    def node_ip(self) -> str:
        return str(ray.util.get_node_ip_address())

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def address(self) -> tuple[str, int]:
        """This node's address and a port free on it: rank 0's, for the rendezvous."""
        ip = self.node_ip()
        return ip, free_port(ip)

    def start(self, spec: WorkerSpec, rank: int, local_rank: int) -> Reply:
        try:
            self.worker = RankWorker(spec, rank, local_rank)
            node = f"{self.node_ip()} (node {self.node_id()[:8]})"
            return ("ok", {**self.worker.describe(), "node": node})
        except BaseException as error:
            return ("error", error_text(error))

    def run(self, command: tuple[Any, ...]) -> Reply:
        assert self.worker is not None
        return self.worker.answer(command)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


class RayDistributedExecutor(DistributedExecutor):
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.actors: list[Any] = []
        self.group: Any = None
        self._pending: deque[list[Any]] = deque()  # per command sent: the ranks' replies
        super().__init__(loaded, config)

    def _start(self, spec: WorkerSpec) -> list[dict[str, Any]]:
        if not ray.is_initialized():
            ray.init(address="auto" if _cluster_running() else None, log_to_driver=False)
        on_gpu = self.config.device.startswith("cuda")
        bundle = {"GPU": 1.0, "CPU": 1.0} if on_gpu else {"CPU": 1.0}
        too_few = ValueError(
            f"the Ray cluster has too few resources for {self.world_size} ranks of {bundle} "
            f"each: it has {_resources(ray.cluster_resources())} in all, "
            f"{_resources(ray.available_resources())} free (add nodes: ray start --address=...)"
        )
        total = ray.cluster_resources()
        if any(total.get(k, 0) < v * self.world_size for k, v in bundle.items()):
            raise too_few
        self.group = placement_group([bundle] * self.world_size, strategy="PACK")
        try:
            ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            raise too_few from None
        try:
            return self._start_actors(spec, on_gpu)
        except RayActorError as error:  # an actor could not even be made (an import)
            raise RuntimeError(f"a Ray worker failed to start: {error}") from None

    def _start_actors(self, spec: WorkerSpec, on_gpu: bool) -> list[dict[str, Any]]:
        actor_class = ray.remote(RankActor)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=rank
            )
            options = dict(num_cpus=1, num_gpus=1 if on_gpu else 0, scheduling_strategy=strategy)
            self.actors.append(actor_class.options(**options).remote())
        ip, port = ray.get(self.actors[0].address.remote(), timeout=STARTUP_TIMEOUT_S)
        spec = replace(spec, init_method=f"tcp://{ip}:{port}")
        nodes = ray.get([a.node_id.remote() for a in self.actors], timeout=STARTUP_TIMEOUT_S)
        local_ranks = [nodes[:rank].count(node) for rank, node in enumerate(nodes)]
        self._pending.append(
            [a.start.remote(spec, rank, local_ranks[rank]) for rank, a in enumerate(self.actors)]
        )
        replies = self._receive(STARTUP_TIMEOUT_S)
        failed = [(rank, text) for rank, (kind, text) in enumerate(replies) if kind == "error"]
        if failed:
            raise RuntimeError(f"worker rank {failed[0][0]} failed to start:\n{failed[0][1]}")
        return [value for _, value in replies]

    def _send(self, command: tuple[Any, ...]) -> None:
        ref = ray.put(command)  # once, for every rank
        self._pending.append([actor.run.remote(ref) for actor in self.actors])

    def _receive(self, timeout_s: float) -> list[Reply]:
        refs = self._pending.popleft()
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        replies = []
        for rank, ref in enumerate(refs):
            if ref not in ready:
                late = [r for r, x in enumerate(refs) if x not in ready]
                raise self._die(f"worker ranks {late} did not answer within {timeout_s:.0f} s")
            try:
                replies.append(ray.get(ref))
            except RayActorError as error:
                raise self._die(f"worker rank {rank} died ({type(error).__name__})") from None
        return replies

    def check_health(self) -> bool:
        """From the cluster's actor table (an actor busy in a step cannot answer a
        ping); where Ray's state API is not there, as of the last step."""
        if self.is_alive and self.actors:
            try:
                from ray._private.state import actors as actor_table

                states = [actor_table(a._actor_id.hex()).get("State") for a in self.actors]
            except Exception:  # the private API moved
                return self.is_alive
            dead = [rank for rank, state in enumerate(states) if state == "DEAD"]
            if dead:
                self._die(f"worker rank {dead[0]}'s actor is dead")
        return self.is_alive

    def _stop(self) -> None:
        try:
            ray.get([a.close.remote() for a in self.actors], timeout=STOP_TIMEOUT_S)
        except Exception:  # ending them below all the same
            logger.warning("Ray workers did not close in %.0f s", STOP_TIMEOUT_S)

    def _kill(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor)
        self.actors = []
        if self.group is not None:
            with contextlib.suppress(Exception):  # the cluster is gone
                remove_placement_group(self.group)
            self.group = None


def _resources(resources: dict[str, float]) -> str:
    return ", ".join(f"{resources.get(k, 0):g} {k}" for k in ("CPU", "GPU"))


def _cluster_running() -> bool:
    """A Ray cluster this machine has joined (`ray start`), or RAY_ADDRESS names one."""
    if os.environ.get("RAY_ADDRESS"):
        return True
    try:
        from ray._private.services import find_gcs_addresses

        return bool(find_gcs_addresses())
    except Exception:  # Ray's private API moved: start a local cluster
        return False
