"""The server's Prometheus metrics from the engine's stats, without a server: the
speculative-decoding totals become vLLM's spec_decode_* counters, step by step."""

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
