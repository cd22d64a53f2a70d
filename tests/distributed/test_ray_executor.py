"""The Ray backend on a two-node Ray cluster that the test starts on this machine (two
`ray start` processes, each a node with its own CPUs): the ranks spread over both nodes
and give one rank's tokens; an actor killed is noticed; too small a cluster is refused
at start. The cluster is stopped afterwards."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.tiny_models import greedy_tokens

from pyengine import LLM
from pyengine.executor import ExecutorDeadError
from pyengine.executor.worker_process import free_port

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

ENGINE = dict(load_format="dummy", max_model_len=128, kv_cache_memory=2**22)


# The `ray` command of this interpreter's environment (beside it in a virtual env).
RAY = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"


def ray_cli(*args: str, env: dict[str, str]) -> None:
    # From outside the checkout: Ray's workers start in the folder the cluster and the
    # driver run from, and there the source tree's pyengine/ (no _C) would shadow the
    # installed one.
    subprocess.run([RAY, *args], check=True, env=env, capture_output=True, timeout=120,
                   cwd=tempfile.gettempdir())  # fmt: skip


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A head node and a second node of one CPU each; RAY_ADDRESS points the engine at
    them. The driver runs from outside the checkout too (see ray_cli)."""
    cwd = os.getcwd()
    os.chdir(tempfile.gettempdir())
    port = free_port("127.0.0.1")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--num-cpus=1", "--disable-usage-stats"]
    try:
        ray_cli("start", "--head", f"--port={port}", "--include-dashboard=false", *common, env=env)
        ray_cli("start", f"--address=127.0.0.1:{port}", *common, env=env)
        os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
        yield os.environ["RAY_ADDRESS"]
    finally:
        os.chdir(cwd)
        os.environ.pop("RAY_ADDRESS", None)
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_ranks_on_two_nodes_give_one_rank_tokens(cluster: str, model: str) -> None:
    expected = greedy_tokens(LLM(model, **ENGINE))
    llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    try:
        nodes = {d["node"] for d in llm.llm_engine.executor.ranks}  # type: ignore[attr-defined]
        assert len(ray.nodes()) == 2
        assert len(nodes) == 2, "a node has one CPU: the ranks must be on both"
        assert greedy_tokens(llm) == expected
        assert llm.llm_engine.scheduler.kv_cache.stats().num_used_blocks == 0
    finally:
        llm.llm_engine.shutdown()
    # Pipeline stages as actors too: a rank per node.
    llm = LLM(model, pipeline_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    try:
        assert greedy_tokens(llm) == expected
    finally:
        llm.llm_engine.shutdown()


def test_a_dead_actor_is_noticed_and_ends_the_rest(cluster: str, model: str) -> None:
    import signal
    import time

    llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    executor = llm.llm_engine.executor
    assert executor.check_health()
    os.kill(int(executor.ranks[1]["pid"]), signal.SIGKILL)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while executor.check_health() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not executor.is_alive, "the dead actor went unnoticed"
    with pytest.raises(ExecutorDeadError):
        greedy_tokens(llm)
    llm.llm_engine.shutdown()


def test_a_cluster_too_small_is_refused_at_start(cluster: str, model: str) -> None:
    with pytest.raises(ValueError, match="the Ray cluster has too few resources for 4 ranks"):
        LLM(model, tensor_parallel_size=4, distributed_executor_backend="ray", **ENGINE)
