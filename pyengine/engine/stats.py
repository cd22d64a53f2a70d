"""EngineStats: the engine's state at a glance, the one type the server's /metrics,
the logs and the benchmarks read."""

from __future__ import annotations

from dataclasses import dataclass

from pyengine import SchedulerStats


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    prefix_cache_hit_rate: float = 0.0
    kv_cache_usage: float = 0.0

    @classmethod
    def of(cls, s: SchedulerStats) -> EngineStats:
        return cls(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_preemptions=s.num_preemptions,
            prefix_cache_hit_rate=s.prefix_cache_hit_rate,
            kv_cache_usage=s.kv_cache_usage,
        )
