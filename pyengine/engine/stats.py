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
    # Since the engine started: prompt tokens looked up in the prefix cache, found, and
    # of those found in the KV host tier; preemptions that swapped out; and the host
    # tier's share of blocks holding KV now.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_host_hits: int = 0
    num_swapped_preemptions: int = 0
    kv_host_usage: float = 0.0
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
            prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
            prefix_cache_host_hits=sum(s.prefix_cache_host_hits for s in stats),
            num_swapped_preemptions=sum(s.num_swapped_preemptions for s in stats),
            kv_host_usage=sum(s.kv_host_usage for s in stats) / n,
        )
