"""The server's Prometheus metrics from the engine's stats, without a server: the
speculative-decoding totals become vLLM's spec_decode_* counters, step by step, and the
prefix cache's tokens counters by tier."""

from __future__ import annotations

from pyengine.engine.stats import EngineStats
from pyengine.entrypoints.openai.metrics import EngineMetrics


def exported(metrics: EngineMetrics) -> dict[str, float]:
    lines = metrics.render().decode().splitlines()
    values = (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))
    return {name: float(value) for name, value in values}


def test_speculative_totals_become_spec_decode_counters() -> None:
    metrics = EngineMetrics("m")
    metrics.on_step(EngineStats(spec_num_drafts=2, spec_num_draft_tokens=7,
                                spec_num_accepted_tokens=4,
                                spec_accepted_per_position=(2, 1, 1)), [], 0)  # fmt: skip
    metrics.on_step(EngineStats(spec_num_drafts=3, spec_num_draft_tokens=11,
                                spec_num_accepted_tokens=8,
                                spec_accepted_per_position=(3, 2, 2, 1)), [], 0)  # fmt: skip
    got = exported(metrics)
    label = '{model_name="m"}'
    assert got[f"pyengine:spec_decode_num_drafts_total{label}"] == 3
    assert got[f"pyengine:spec_decode_num_draft_tokens_total{label}"] == 11
    assert got[f"pyengine:spec_decode_num_accepted_tokens_total{label}"] == 8
    per_pos = "pyengine:spec_decode_num_accepted_tokens_per_pos_total"
    for position, total in enumerate((3, 2, 2, 1)):
        assert got[f'{per_pos}{{model_name="m",position="{position}"}}'] == total


def test_an_engine_without_speculation_counts_nothing() -> None:
    metrics = EngineMetrics("m")
    metrics.on_step(EngineStats(num_running=1), [], 3)
    got = exported(metrics)
    assert not any(name.startswith("pyengine:spec_decode") for name in got)


def test_prefix_cache_tokens_are_counted_by_the_tier_that_held_them() -> None:
    metrics = EngineMetrics("m")
    metrics.on_step(EngineStats(prefix_cache_queries=100, prefix_cache_hits=48,
                                prefix_cache_host_hits=16, num_preemptions=2,
                                num_swapped_preemptions=1, kv_host_usage=0.25), [], 0)  # fmt: skip
    metrics.on_step(EngineStats(prefix_cache_queries=160, prefix_cache_hits=96,
                                prefix_cache_host_hits=48, num_preemptions=3,
                                num_swapped_preemptions=1, kv_host_usage=0.5), [], 0)  # fmt: skip
    got = exported(metrics)
    label = '{model_name="m"}'
    assert got[f"pyengine:prefix_cache_queries_total{label}"] == 160
    assert got['pyengine:prefix_cache_hits_total{model_name="m",tier="device"}'] == 48
    assert got['pyengine:prefix_cache_hits_total{model_name="m",tier="host"}'] == 48
    assert got[f"pyengine:num_preemptions_total{label}"] == 3
    assert got[f"pyengine:num_preemptions_swapped_total{label}"] == 1
    assert got[f"pyengine:kv_offload_usage_perc{label}"] == 0.5
