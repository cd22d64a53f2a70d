"""The server's Prometheus metrics (names as vLLM's, under `pyengine:`), fed by the engine
thread after every step; each server has its own registry."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pyengine.engine.stats import EngineStats
from pyengine.entrypoints.openai.admission import WaitingBound
from pyengine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pyengine:{name}", doc, labels, registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"pyengine:{name}", doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                f"pyengine:{name}", doc, labels, buckets=buckets, registry=self.registry
            )

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use.")
        self.hit_rate = gauge("prefix_cache_hit_rate", "Prefix-cache hits per block looked up.")
        self.preemptions = counter("num_preemptions", "Requests preempted.")
        self.swapped = counter(
            "num_preemptions_swapped", "Of those, requests swapped out to the KV host tier."
        )
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "prefix_cache_hits", "Of those, tokens found cached, by the tier that held them "
            "(device, or host: brought back from --kv-offload-gb).", ("tier",),
        )  # fmt: skip
        self.offload_usage = gauge(
            "kv_offload_usage_perc", "Fraction of the KV host tier's blocks holding KV."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.finished = counter(
            "request_success", "Finished requests by finish reason.", ("finished_reason",)
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "time_per_output_token_seconds", "Mean time per token after the first.", _TOKEN_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.stalled = counter(
            "stream_stalled", "Responses whose client took no data for the stall timeout: "
            "their connections closed, their requests aborted.",
        )  # fmt: skip
        # As vLLM's: one series, its labels the adapters running and waiting, its value
        # the time they were read.
        self.lora_info = Gauge(
            "pyengine:lora_requests_info", "LoRA adapters of the running and waiting requests.",
            ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            registry=self.registry,
        )  # fmt: skip
        self.spec_drafts = counter("spec_decode_num_drafts", "Rows that verified draft tokens.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position of a row's drafts.", ("position",),
        )  # fmt: skip
        self._model = model_name
        self._totals_seen: dict[str, int] = {}  # engine totals already counted, by name
        self._spec_seen: tuple[int, int, int] = (0, 0, 0)
        self._spec_per_pos_seen: list[int] = []
        for metric in (self.running, self.waiting, self.kv_usage, self.hit_rate):
            metric.labels(model_name).set(0)  # exported from the start
        for counter_ in (self.preemptions, self.prompt_tokens, self.generation_tokens,
                         self.stalled, self.prefix_queries):  # fmt: skip
            counter_.labels(model_name)
        for tier in ("device", "host"):
            self.prefix_hits.labels(model_name, tier)

    def watch(self, bound: WaitingBound) -> None:
        """The server's bound on waiting work: its limits, what it holds, what it refused."""
        m = self._model
        values = {
            "max_waiting_requests": ("The bound on requests waiting to be scheduled "
                                     "(-1: none).", lambda: _or_none(bound.max_requests)),
            "max_waiting_prompt_tokens": ("The bound on their prompt tokens (-1: none).",
                                          lambda: _or_none(bound.max_prompt_tokens)),
            "num_requests_admitted_waiting": ("Requests the server holds with no token yet.",
                                              lambda: bound.requests),
        }  # fmt: skip
        for name, (doc, value) in values.items():
            Gauge(f"pyengine:{name}", doc, ["model_name"], registry=self.registry).labels(
                m).set_function(value)  # fmt: skip
        refused = Counter(
            "pyengine:request_refused", "Requests refused with 429: the server was overloaded.",
            ["model_name"], registry=self.registry,
        )  # fmt: skip
        bound.on_refused = refused.labels(m).inc

    def count_stall(self) -> None:
        """A client stopped reading (slow_clients.StallGuard); called on the event loop."""
        self.stalled.labels(self._model).inc()

    def on_step(self, stats: EngineStats, finished: list[RequestOutput], generated: int) -> None:
        m = self._model
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        self.hit_rate.labels(m).set(stats.prefix_cache_hit_rate)
        self.offload_usage.labels(m).set(stats.kv_host_usage)
        host_hits = stats.prefix_cache_host_hits
        totals = {
            "preemptions": (self.preemptions.labels(m), stats.num_preemptions),
            "swapped": (self.swapped.labels(m), stats.num_swapped_preemptions),
            "queries": (self.prefix_queries.labels(m), stats.prefix_cache_queries),
            "device": (self.prefix_hits.labels(m, "device"), stats.prefix_cache_hits - host_hits),
            "host": (self.prefix_hits.labels(m, "host"), host_hits),
        }
        for name, (child, total) in totals.items():
            seen = self._totals_seen.get(name, 0)
            if total > seen:
                child.inc(total - seen)
                self._totals_seen[name] = total
        if generated:
            self.generation_tokens.labels(m).inc(generated)
        self._count_speculation(stats)
        if stats.max_loras:
            self.lora_info.clear()
            self.lora_info.labels(",".join(stats.running_loras), ",".join(stats.waiting_loras),
                                  str(stats.max_loras)).set(time.time())  # fmt: skip
        for out in finished:
            self._record_finished(out)

    def _count_speculation(self, stats: EngineStats) -> None:
        """The engine's speculative-decoding totals, as increments since the last step."""
        m = self._model
        totals = (stats.spec_num_drafts, stats.spec_num_draft_tokens,
                  stats.spec_num_accepted_tokens)  # fmt: skip
        counters = (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted)
        for counter_, total, seen in zip(counters, totals, self._spec_seen, strict=True):
            if total > seen:
                counter_.labels(m).inc(total - seen)
        self._spec_seen = totals
        per_pos = stats.spec_accepted_per_position
        for j, total in enumerate(per_pos):
            seen = self._spec_per_pos_seen[j] if j < len(self._spec_per_pos_seen) else 0
            if total > seen:
                self.spec_accepted_per_pos.labels(m, str(j)).inc(total - seen)
        self._spec_per_pos_seen = list(per_pos)

    def _record_finished(self, out: RequestOutput) -> None:
        m, t = self._model, out.metrics
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        # The output is the request's last delta, which holds only what its last step
        # added: each sample's finish and length come from its metrics.
        for reason in t.finish_reasons:
            self.finished.labels(m, reason).inc()
        if t.finished_time is not None:
            self.e2e.labels(m).observe(t.finished_time - t.arrival_time)
        if t.first_token_time is None:
            return
        self.ttft.labels(m).observe(t.first_token_time - t.arrival_time)
        tokens = max(t.num_output_tokens, default=0)
        if t.finished_time is not None and tokens > 1:
            self.tpot.labels(m).observe((t.finished_time - t.first_token_time) / (tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _or_none(bound: int | None) -> float:
    return -1.0 if bound is None else float(bound)
