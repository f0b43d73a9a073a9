"""The proxy's Prometheus metrics: the contract of docs/design.md, ``whoseturn_`` only.

Request-path numbers (latencies, counts, tokens) are recorded as they happen.
Scheduler state (turn, budget, work in flight, queues, engine health) is read from
the scheduler at scrape time by a custom collector, so the gauges can never
disagree with ``/turn``. Everything lives on a registry owned by the app.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.scheduler import HeldReason, Scheduler, TrafficClass, Turn

TTFT_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5,
    0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
)  # fmt: skip
GAP_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
)  # fmt: skip
QUEUE_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0, 900.0, 3600.0,
)  # fmt: skip

OUTCOMES = ("ok", "client_error", "engine_error", "cancelled", "rejected")
BATCH_RECORD_STATUSES = ("valid", "invalid", "failed")


class SchedulerCollector(Collector):
    """Turn, budget, in-flight work, queues and engine health, read at scrape time."""

    def __init__(
        self,
        scheduler: Scheduler,
        ttft_targets: dict[TrafficClass, float],
        gap_targets: dict[TrafficClass, float],
        engine_urls: dict[str, str],
    ) -> None:
        self.scheduler = scheduler
        self.ttft_targets = ttft_targets
        self.gap_targets = gap_targets
        self.engine_urls = engine_urls

    def collect(self) -> Iterator[Metric]:
        engines = list(self.scheduler.engines.values())
        turn = GaugeMetricFamily(
            "whoseturn_turn", "1 for the engine's current turn, 0 for the others",
            labels=["engine", "turn"],
        )  # fmt: skip
        turn_s = CounterMetricFamily(
            "whoseturn_turn_seconds", "Time each engine spent in each turn",
            labels=["engine", "turn"],
        )  # fmt: skip
        held = CounterMetricFamily(
            "whoseturn_batch_held_seconds", "Time batch work was held, by reason",
            labels=["engine", "reason"],
        )  # fmt: skip
        budget = GaugeMetricFamily(
            "whoseturn_prefill_budget_tokens", "Batch prefill budget B", labels=["engine"]
        )
        prefill = GaugeMetricFamily(
            "whoseturn_prefill_inflight_tokens", "Prompt tokens dispatched, no first token yet",
            labels=["engine", "class"],
        )  # fmt: skip
        decode = GaugeMetricFamily(
            "whoseturn_decode_inflight_requests", "Streams in decode", labels=["engine", "class"]
        )
        up = GaugeMetricFamily(
            "whoseturn_engine_up", "1 if the engine is in service", labels=["engine"]
        )
        info = GaugeMetricFamily(
            "whoseturn_engine_info", "The engine's URL, to join with its own metrics",
            labels=["engine", "url"],
        )  # fmt: skip
        for e in engines:
            for t in Turn:
                turn.add_metric([e.name, t.value], 1.0 if e.turn is t else 0.0)
                turn_s.add_metric([e.name, t.value], e.turn_seconds[t])
            for r in HeldReason:
                held.add_metric([e.name, r.value], e.held_seconds[r])
            budget.add_metric([e.name], e.budget.tokens)
            for c in TrafficClass:
                prefill.add_metric([e.name, c.value], e.prefill_tokens(c))
                decode.add_metric([e.name, c.value], e.decode_streams(c))
            up.add_metric([e.name], 1.0 if e.up else 0.0)
            info.add_metric([e.name, self.engine_urls.get(e.name, "")], 1.0)
        yield from (turn, turn_s, held, budget, prefill, decode, up, info)
        yield from self._queues()

    def _queues(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "whoseturn_queue_depth", "Requests waiting in the proxy", labels=["class"]
        )
        target = GaugeMetricFamily(
            "whoseturn_ttft_target_seconds", "Configured TTFT target", labels=["class"]
        )
        gap = GaugeMetricFamily(
            "whoseturn_inter_token_target_seconds", "Configured inter-token gap target (p95)",
            labels=["class"],
        )  # fmt: skip
        for c in TrafficClass:
            depth.add_metric([c.value], len(self.scheduler.queues[c]))
            if c in self.ttft_targets:
                target.add_metric([c.value], self.ttft_targets[c])
            if c in self.gap_targets:
                gap.add_metric([c.value], self.gap_targets[c])
        yield from (depth, target, gap)


class ProxyMetrics:
    """Recorders for the request path, on a registry of the app's own."""

    def __init__(
        self,
        scheduler: Scheduler,
        ttft_target_s: float,
        gap_target_s: float = 0.1,
        engine_urls: dict[str, str] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ce = ["class", "engine"]
        self.queue_wait = Histogram(
            "whoseturn_queue_wait_seconds", "Time in the proxy's queue", ["class"],
            buckets=QUEUE_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "whoseturn_ttft_seconds", "Arrival at the proxy to first token", ce,
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.prefill = Histogram(
            "whoseturn_prefill_seconds", "Dispatch to first token", ce,
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.inter_token = Histogram(
            "whoseturn_inter_token_seconds", "Gap between tokens of a stream", ce,
            buckets=GAP_BUCKETS, registry=r,
        )  # fmt: skip
        self.request = Histogram(
            "whoseturn_request_seconds", "Arrival at the proxy to last byte", ce,
            buckets=REQUEST_BUCKETS, registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "whoseturn_requests", "Requests by outcome", [*ce, "outcome"], registry=r
        )
        self.prompt_tokens = Counter(
            "whoseturn_prompt_tokens", "Prompt tokens (engine usage)", ce, registry=r
        )
        self.completion_tokens = Counter(
            "whoseturn_completion_tokens", "Completion tokens (engine usage)", ce, registry=r
        )
        self.batch_records = Counter(
            "whoseturn_batch_records", "Batch records by status", ["status"], registry=r
        )
        ttft = {TrafficClass.INTERACTIVE: ttft_target_s}
        gap = {TrafficClass.INTERACTIVE: gap_target_s}
        r.register(SchedulerCollector(scheduler, ttft, gap, engine_urls or {}))
        self._create_children(scheduler)

    def _create_children(self, scheduler: Scheduler) -> None:
        """Counters start at 0 for every known label set, so that ``increase()`` sees
        the first event too."""
        for status in BATCH_RECORD_STATUSES:
            self.batch_records.labels(status)
        for c in TrafficClass:
            for engine in scheduler.engines:
                self.prompt_tokens.labels(c.value, engine)
                self.completion_tokens.labels(c.value, engine)
                for outcome in OUTCOMES:
                    self.requests.labels(c.value, engine, outcome)
