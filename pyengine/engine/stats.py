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
    # With enable_lora: the adapters of the running and of the waiting requests (names,
    # sorted), and max_loras (vLLM's lora_requests_info).
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    max_loras: int = 0
    # With speculative decoding, since the engine started (vLLM's spec_decode_* counters):
    # rows that verified drafts, draft tokens, those accepted, and accepted per position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()

    @classmethod
    def of(cls, stats: list[SchedulerStats]) -> EngineStats:
        """Of the engine's schedulers (one per pipeline step in flight, each with an
        equal share of the KV blocks): counts summed, rates averaged."""
        n = len(stats)
        return cls(
            num_running=sum(s.num_running for s in stats),
            num_waiting=sum(s.num_waiting for s in stats),
            num_preemptions=sum(s.num_preemptions for s in stats),
            prefix_cache_hit_rate=sum(s.prefix_cache_hit_rate for s in stats) / n,
            kv_cache_usage=sum(s.kv_cache_usage for s in stats) / n,
        )
