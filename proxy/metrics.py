"""The proxy's Prometheus metrics: the contract of docs/design.md, ``whoseturn_`` only.

Request-path numbers (latencies, counts, tokens) are recorded as they happen.
Scheduler state (turn, budget, work in flight, queues, engine health) is read from
the scheduler at scrape time by a custom collector, so the gauges can never
disagree with ``/turn``. Everything lives on a registry owned by the app.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.scheduler import EngineState, Scheduler, TrafficClass

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

CLASS_ENGINE = ("class", "engine")
OUTCOMES = ("ok", "client_error", "engine_error", "cancelled", "rejected")
BATCH_RECORD_STATUSES = ("completed", "failed", "valid", "invalid")


def _gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def _counter(name: str, doc: str, *labels: str) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=list(labels))


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
        """Every family, read from the scheduler as it stands (a read: nothing runs)."""
        engines = list(self.scheduler.engines.values())
        yield from self._turns(engines, self.scheduler.clock.now())
        yield from self._work(engines)
        yield from self._queues()

    def _turns(self, engines: list[EngineState], now: float) -> Iterator[Metric]:
        turn = _gauge(
            "whoseturn_turn", "1 for the engine's current turn, 0 for the others", "engine", "turn"
        )
        turn_s = _counter(
            "whoseturn_turn_seconds", "Time each engine spent in each turn", "engine", "turn"
        )
        held = _counter(
            "whoseturn_batch_held_seconds",
            "Time batch work was held, by reason",
            "engine",
            "reason",
        )
        for e in engines:
            for t, seconds in e.turn_seconds_at(now).items():
                turn.add_metric([e.name, t.value], 1.0 if e.turn is t else 0.0)
                turn_s.add_metric([e.name, t.value], seconds)
            for r, seconds in e.held_seconds_at(now).items():
                held.add_metric([e.name, r.value], seconds)
        yield from (turn, turn_s, held)

    def _work(self, engines: list[EngineState]) -> Iterator[Metric]:
        budget = _gauge("whoseturn_prefill_budget_tokens", "Batch prefill budget B", "engine")
        prefill = _gauge(
            "whoseturn_prefill_inflight_tokens",
            "Prompt tokens dispatched, no first token yet",
            "engine",
            "class",
        )
        decode = _gauge(
            "whoseturn_decode_inflight_requests", "Streams in decode", "engine", "class"
        )
        others = _gauge(
            "whoseturn_replicas_batch_prefill_tokens",
            "Other proxy replicas' batch prompt tokens in prefill, from the shared ledger",
            "engine",
        )
        up = _gauge("whoseturn_engine_up", "1 if the engine is in service", "engine")
        info = _gauge(
            "whoseturn_engine_info",
            "The engine's URL, to join with its own metrics",
            "engine",
            "url",
        )
        for e in engines:
            budget.add_metric([e.name], e.budget.tokens)
            for c in TrafficClass:
                prefill.add_metric([e.name, c.value], e.prefill_tokens(c))
                decode.add_metric([e.name, c.value], e.decode_streams(c))
            others.add_metric([e.name], e.others.batch_prefill_tokens)
            up.add_metric([e.name], 1.0 if e.up else 0.0)
            info.add_metric([e.name, self.engine_urls.get(e.name, "")], 1.0)
        yield from (budget, prefill, decode, others, up, info)

    def _queues(self) -> Iterator[Metric]:
        depth = _gauge("whoseturn_queue_depth", "Requests waiting in the proxy", "class")
        target = _gauge("whoseturn_ttft_target_seconds", "Configured TTFT target", "class")
        gap = _gauge(
            "whoseturn_inter_token_target_seconds",
            "Configured inter-token gap target (p95)",
            "class",
        )
        for c in TrafficClass:
            depth.add_metric([c.value], len(self.scheduler.queues[c]))
            if c in self.ttft_targets:
                target.add_metric([c.value], self.ttft_targets[c])
            if c in self.gap_targets:
                gap.add_metric([c.value], self.gap_targets[c])
        yield from (depth, target, gap)


class LedgerState(Protocol):
    """What the shared budget (:class:`proxy.replicas.SharedBudget`) says of its ledger."""

    @property
    def up(self) -> bool: ...

    @property
    def outages(self) -> int: ...

    @property
    def local_grants(self) -> int: ...


class LedgerCollector(Collector):
    """The shared ledger's state, read at scrape time (registered only where several
    replicas share the engines' budgets, docs/replicas.md)."""

    def __init__(self, ledger: LedgerState) -> None:
        self.ledger = ledger

    def collect(self) -> Iterator[Metric]:
        up = _gauge(
            "whoseturn_ledger_up",
            "1 while the shared ledger answers; 0 while this replica runs batch on a local budget",
        )
        up.add_metric([], 1.0 if self.ledger.up else 0.0)
        outages = _counter("whoseturn_ledger_outages", "Times the shared ledger went down")
        outages.add_metric([], self.ledger.outages)
        local = _counter(
            "whoseturn_ledger_local_reservations",
            "Batch requests sent on the local budget while the shared ledger was down",
        )
        local.add_metric([], self.ledger.local_grants)
        yield from (up, outages, local)


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
        self.queue_wait = self._histogram(
            "whoseturn_queue_wait_seconds", "Time in the proxy's queue", QUEUE_BUCKETS, ["class"]
        )
        self.ttft = self._histogram(
            "whoseturn_ttft_seconds", "Arrival at the proxy to first token", TTFT_BUCKETS
        )
        self.prefill = self._histogram(
            "whoseturn_prefill_seconds", "Dispatch to first token", TTFT_BUCKETS
        )
        self.inter_token = self._histogram(
            "whoseturn_inter_token_seconds", "Gap between tokens of a stream", GAP_BUCKETS
        )
        self.request = self._histogram(
            "whoseturn_request_seconds", "Arrival at the proxy to last byte", REQUEST_BUCKETS
        )
        self.requests = self._counter(
            "whoseturn_requests", "Requests by outcome", [*CLASS_ENGINE, "outcome"]
        )
        self.prompt_tokens = self._counter(
            "whoseturn_prompt_tokens", "Prompt tokens (engine usage)"
        )
        self.completion_tokens = self._counter(
            "whoseturn_completion_tokens", "Completion tokens (engine usage)"
        )
        self.batch_records = self._counter(
            "whoseturn_batch_records", "Batch records by status", ["status"]
        )
        ttft = {TrafficClass.INTERACTIVE: ttft_target_s}
        gap = {TrafficClass.INTERACTIVE: gap_target_s}
        self.registry.register(
            SchedulerCollector(scheduler, ttft, gap, engine_urls if engine_urls is not None else {})
        )
        self._create_children(scheduler)

    def _histogram(
        self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = CLASS_ENGINE
    ) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def _counter(self, name: str, doc: str, labels: Sequence[str] = CLASS_ENGINE) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

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
