"""The proxy's Prometheus metrics, every one declared here: the contract of
docs/design.md, ``whoseturn_`` only, in the order docs/metrics.md lists them
(``tests/unit/test_metrics_docs.py`` holds the two to the same list).

Each family is declared once, here, and registered in that order on a registry
owned by the app (:class:`ProxyMetrics`, built in the composition root). The
floors above feed them without declaring any:

- the scheduler's state (turn, budget, work in flight, queues, engines) is read
  at scrape time (:class:`SchedulerCollector`), so the gauges can never disagree
  with ``/turn``;
- the request path (:mod:`proxy.api`) records latencies, outcomes and tokens as
  they happen, and the piecing of long prompts its counters (:class:`PieceMetrics`);
- the shared ledger (:mod:`proxy.replicas`) and the Batch API (:mod:`proxy.batch`)
  attach what their families read at scrape time (:class:`LedgerState`,
  :class:`Health`, :class:`Deadline`); until they do, their families are not
  exported (one replica alone; batch off);
- each tenant's requests, waits, TTFT, tokens and refusals are counted as they
  happen, and its queue, work in flight and share of its class read from the
  scheduler at scrape time (:class:`TenantMetrics`). Its label is its name only for
  a tenant named in the config; every other tenant is ``other``, so the series stay
  as few as the config makes them whoever calls.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from proxy.scheduler import EngineState, Scheduler, TrafficClass
from proxy.scheduler.fair import TenantShare

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
ENGINE_CLASS = ("engine", "class")
OUTCOMES = ("ok", "client_error", "engine_error", "cancelled", "rejected")
BATCH_RECORD_STATUSES = ("completed", "failed", "valid", "invalid")
BATCH_TOKEN_KINDS = ("prompt", "completion")
PIECE_FALLBACKS = ("cache_miss", "piece_failed")
TENANT_TOKEN_KINDS = ("prompt", "completion")
# a tenant's limits (proxy.config.TenantLimits), the values of ``limit``
TENANT_LIMITS = ("requests_per_minute", "tokens_per_minute", "streams", "batch_jobs", "batch_lines")
OTHER_TENANT = "other"  # the label of every tenant the config does not name
TENANT_CLASS = ("tenant", "class")


def _gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def _counter(name: str, doc: str, *labels: str) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=list(labels))


class SchedulerCollector(Collector):
    """Turn, budget, in-flight work, queues and engines, read at scrape time."""

    def __init__(self, scheduler: Scheduler, engine_urls: Mapping[str, str]) -> None:
        self.scheduler = scheduler
        self.engine_urls = engine_urls

    def collect(self) -> Iterator[Metric]:
        """Every family, read from the scheduler as it stands (a read: nothing runs)."""
        engines = list(self.scheduler.engines.values())
        yield from self._turns(engines, self.scheduler.clock.now())
        yield from self._work(engines)
        yield self._queue_depth()
        yield from self._engines(engines)

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
            *ENGINE_CLASS,
        )
        decode = _gauge("whoseturn_decode_inflight_requests", "Streams in decode", *ENGINE_CLASS)
        for e in engines:
            budget.add_metric([e.name], e.budget.tokens)
            for c in TrafficClass:
                prefill.add_metric([e.name, c.value], e.prefill_tokens(c))
                decode.add_metric([e.name, c.value], e.decode_streams(c))
        yield from (budget, prefill, decode)

    def _queue_depth(self) -> Metric:
        depth = _gauge("whoseturn_queue_depth", "Requests waiting in the proxy", "class")
        for c in TrafficClass:
            depth.add_metric([c.value], len(self.scheduler.queues[c]))
        return depth

    def _engines(self, engines: list[EngineState]) -> Iterator[Metric]:
        up = _gauge("whoseturn_engine_up", "1 if the engine is in service", "engine")
        info = _gauge(
            "whoseturn_engine_info",
            "The engine's URL, to join with its own metrics",
            "engine",
            "url",
        )
        others = _gauge(
            "whoseturn_replicas_batch_prefill_tokens",
            "Other proxy replicas' batch prompt tokens in prefill, from the shared ledger",
            "engine",
        )
        index = _gauge(
            "whoseturn_prefix_index_blocks",
            "Blocks the proxy's prefix index holds for the engine, by how it is kept "
            "(events: the engine's KV events; routed: what was sent there)",
            "engine",
            "mode",
        )
        for e in engines:
            up.add_metric([e.name], 1.0 if e.up else 0.0)
            info.add_metric([e.name, self.engine_urls.get(e.name, "")], 1.0)
            others.add_metric([e.name], e.others.batch_prefill_tokens)
            index.add_metric([e.name, e.prefix.mode.value], len(e.prefix))
        routes = _counter(
            "whoseturn_route_decisions", "Requests sent to an engine, by why it was chosen", "why"
        )
        for why, n in self.scheduler.route_counts.items():
            routes.add_metric([why], n)
        yield from (up, info, others, index, routes)


class Health(Protocol):
    """Whether a store answers, and how many outages it has had."""

    @property
    def up(self) -> bool: ...

    @property
    def outages(self) -> int: ...


class LedgerState(Health, Protocol):
    """What the shared budget (:class:`proxy.replicas.SharedBudget`) says of its ledger."""

    @property
    def local_grants(self) -> int: ...


class LedgerCollector(Collector):
    """The shared ledger's state, read at scrape time; nothing until a ledger is
    attached (only where several replicas share the engines' budgets, docs/replicas.md)."""

    def __init__(self, ledger: LedgerState | None = None) -> None:
        self.ledger = ledger

    def attach(self, ledger: LedgerState) -> None:
        self.ledger = ledger

    def collect(self) -> Iterator[Metric]:
        if self.ledger is None:
            return
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


class LineCounts(Protocol):
    """A batch line's recorded result, as the counters see it
    (:class:`proxy.batch.store.LineResult`)."""

    @property
    def ok(self) -> bool: ...

    @property
    def quality(self) -> str: ...

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...


class Deadline(NamedTuple):
    """An active batch job's two timestamps (epoch seconds; no estimate yet: None)."""

    batch: str
    expires_at: float
    estimated_completion_at: float | None


class BatchMetrics(Collector):
    """The Batch API's families. ``whoseturn_batch_records_total{status}`` is
    always exported; the others once :meth:`attach` is called (batch on): the job
    counts and tokens as the runner sets them, the store's health and the active
    jobs' deadlines read at each scrape."""

    def __init__(self) -> None:
        self.records = Counter(
            "whoseturn_batch_records", "Batch records by status", ["status"], registry=None
        )
        for status in BATCH_RECORD_STATUSES:
            self.records.labels(status)
        self.jobs = Gauge("whoseturn_batch_jobs", "Batch jobs by status", ["status"], registry=None)
        self.tokens = Counter(
            "whoseturn_batch_tokens",
            "Tokens of batch job lines (engine usage)",
            ["kind"],
            registry=None,
        )
        for kind in BATCH_TOKEN_KINDS:
            self.tokens.labels(kind)
        self.store: Health | None = None
        self.deadlines: Callable[[], Iterable[Deadline]] = lambda: ()

    def attach(self, store: Health, deadlines: Callable[[], Iterable[Deadline]]) -> None:
        """Export the batch families: the store's ``health``, the active jobs' ``deadlines``."""
        self.store = store
        self.deadlines = deadlines

    def set_jobs(self, counts: Mapping[str, int]) -> None:
        """The jobs in the store, by status."""
        for status, count in counts.items():
            self.jobs.labels(status).set(count)

    def count(self, result: LineCounts) -> None:
        """A line's result recorded."""
        if result.quality:
            self.records.labels(result.quality).inc()
        self.records.labels("completed" if result.ok else "failed").inc()
        self.tokens.labels("prompt").inc(result.prompt_tokens)
        self.tokens.labels("completion").inc(result.completion_tokens)

    def collect(self) -> Iterator[Metric]:
        yield from self.records.collect()
        if self.store is None:
            return
        yield from self.jobs.collect()
        up = _gauge("whoseturn_batch_store_up", "Whether the batch store answers (1) or not (0)")
        up.add_metric([], 1.0 if self.store.up else 0.0)
        outages = _counter(
            "whoseturn_batch_store_outages", "Batch store outages since the proxy started"
        )
        outages.add_metric([], float(self.store.outages))
        yield from (up, outages)
        yield from self.tokens.collect()
        yield from self._deadlines()

    def _deadlines(self) -> Iterator[Metric]:
        eta = _gauge(
            "whoseturn_batch_estimated_completion_timestamp_seconds",
            "When an active batch job is estimated to be done (epoch seconds)",
            "batch",
        )
        expires = _gauge(
            "whoseturn_batch_expires_timestamp_seconds",
            "When an active batch job's completion window ends (epoch seconds)",
            "batch",
        )
        for job in self.deadlines():
            expires.add_metric([job.batch], job.expires_at)
            if job.estimated_completion_at is not None:
                eta.add_metric([job.batch], job.estimated_completion_at)
        yield from (eta, expires)


class PieceMetrics:
    """``whoseturn_prefill_pieces_total{engine}`` and its companions, counted by
    :class:`proxy.api.piece_sender.PieceSender`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def by_engine(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, ["engine", *labels], registry=registry)

        self.pieces = by_engine(
            "whoseturn_prefill_pieces", "Prefix pieces of long batch prompts sent to an engine"
        )
        self.prompts = by_engine(
            "whoseturn_prefill_pieced_prompts",
            "Batch prompts sent whole after their pieces (the real request)",
        )
        self.fallbacks = by_engine(
            "whoseturn_prefill_piece_fallbacks",
            "Pieced prompts sent whole early: the cache did not hold, or a piece failed",
            "reason",
        )
        self.aborts = by_engine(
            "whoseturn_batch_aborts",
            "Batch requests aborted in prefill on an engine for a chat, to be requeued",
        )
        self.requeues = by_engine(
            "whoseturn_batch_requeues", "Batch requests sent again to an engine after an abort"
        )

    def add(self, name: str) -> None:
        """Export engine ``name``'s series at zero from the start."""
        self.pieces.labels(name)
        self.prompts.labels(name)
        self.aborts.labels(name)
        self.requeues.labels(name)
        for reason in PIECE_FALLBACKS:
            self.fallbacks.labels(name, reason)


class CardReads(Protocol):
    """What the card gauges read at scrape time (:class:`proxy.cards.CardKeeper`)."""

    @property
    def name(self) -> str: ...

    def awake_by_model(self) -> Mapping[str, tuple[str, bool]]:
        """Each model on the card: its engine, and whether it serves now."""
        ...

    @property
    def swapping(self) -> bool: ...


SWAP_STEPS = ("sleep", "wake")
SWAP_WHYS = ("nothing_awake", "deadline", "chat", "chat_turn", "batch_window")
SWAP_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 900.0)


class CardMetrics(Collector):
    """Several models on one card (docs/scheduling.md): which is awake, the swaps,
    their steps' durations, and the requests' waits for a wake. Exported once a
    card is configured (:meth:`attach`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._cards: list[CardReads] = []
        registry.register(self)
        self.swaps = Counter(
            "whoseturn_model_swaps",
            "Swaps on a card, by the model woken and what for",
            ["card", "model", "why"],
            registry=None,
        )
        self.failures = Counter(
            "whoseturn_model_swap_failures",
            "Swaps on a card that failed (the model could not be put to sleep or woken)",
            ["card", "model"],
            registry=None,
        )
        self.step_seconds = Histogram(
            "whoseturn_model_swap_seconds",
            "A swap's steps: the awake model put to sleep, the next one woken",
            ["card", "model", "step"],
            buckets=SWAP_BUCKETS,
            registry=None,
        )
        self.activation_wait = Histogram(
            "whoseturn_activation_wait_seconds",
            "Arrival to dispatch of requests that arrived while their model was not awake",
            ["class", "model"],
            buckets=QUEUE_BUCKETS,
            registry=None,
        )

    def attach(self, card: CardReads) -> None:
        """Export ``card``'s series, at zero from the start."""
        self._cards.append(card)
        for model in card.awake_by_model():
            self.failures.labels(card.name, model)
            for why in SWAP_WHYS:
                self.swaps.labels(card.name, model, why)
            for step in SWAP_STEPS:
                self.step_seconds.labels(card.name, model, step)
            for cls in TrafficClass:
                self.activation_wait.labels(cls.value, model)

    def collect(self) -> Iterator[Metric]:
        if not self._cards:
            return
        awake = _gauge(
            "whoseturn_model_awake",
            "1 while the model serves on its card's engine, 0 asleep or being swapped",
            "card", "model", "engine",
        )  # fmt: skip
        swapping = _gauge("whoseturn_card_swapping", "1 while a swap runs on the card", "card")
        for card in self._cards:
            for model, (engine, up) in card.awake_by_model().items():
                awake.add_metric([card.name, model, engine], 1.0 if up else 0.0)
            swapping.add_metric([card.name], 1.0 if card.swapping else 0.0)
        yield awake
        yield swapping
        yield from self.swaps.collect()
        yield from self.failures.collect()
        yield from self.step_seconds.collect()
        yield from self.activation_wait.collect()


class TenantReads(Protocol):
    """What the per-tenant gauges read at scrape time (:class:`Scheduler`)."""

    def tenant_shares(self) -> Sequence[TenantShare]: ...

    def fairness(self, cls: TrafficClass) -> float | None: ...


class TenantCollector(Collector):
    """Each tenant's queue, work in flight, share and what it is owed, and each
    class's fairness index, read from the scheduler at scrape time. Tenants that
    share a label (``other``) are summed: their jobs, their part of the class's
    tokens and of its weights add up."""

    def __init__(self, reads: TenantReads, label: Callable[[str], str]) -> None:
        self.reads = reads
        self.label = label

    def collect(self) -> Iterator[Metric]:
        """The families, from one read of the scheduler (nothing runs)."""
        queued = _gauge(
            "whoseturn_tenant_queued", "Tenant's requests queued in the proxy", *TENANT_CLASS
        )
        in_flight = _gauge(
            "whoseturn_tenant_in_flight", "Tenant's requests on engines", *TENANT_CLASS
        )
        share = _gauge(
            "whoseturn_tenant_share",
            "Tenant's part of its class's tokens served in the fair-share window",
            *TENANT_CLASS,
        )
        owed = _gauge(
            "whoseturn_tenant_owed_share",
            "Tenant's weight over the weights of its class's active tenants",
            *TENANT_CLASS,
        )
        sums: dict[tuple[str, str], list[float]] = {}
        for t in self.reads.tenant_shares():
            row = sums.setdefault((self.label(t.tenant), t.cls.value), [0.0, 0.0, 0.0, 0.0])
            for i, part in enumerate((t.queued, t.in_flight, t.share, t.owed)):
                row[i] += part
        for key, (q, f, s, o) in sums.items():
            queued.add_metric(list(key), q)
            in_flight.add_metric(list(key), f)
            share.add_metric(list(key), s)
            owed.add_metric(list(key), o)
        index = _gauge(
            "whoseturn_fairness_index",
            "Jain's index of tokens served over weight, of the class's tenants that "
            "waited in the window (1: fair; absent with fewer than two)",
            "class",
        )
        for c in TrafficClass:
            value = self.reads.fairness(c)
            if value is not None:
                index.add_metric([c.value], value)
        yield from (queued, in_flight, share, owed, index)


class TenantMetrics:
    """``whoseturn_tenant_*`` and ``whoseturn_fairness_index``: what each tenant sent
    and got. Labels are bounded by the config: a tenant it names by its name, every
    other tenant (anonymous, a key's hash, a client's address) ``other``. The request
    path counts requests, waits, TTFT and tokens; the HTTP edge and the batch runner
    count refusals (:meth:`limited`)."""

    def __init__(
        self, registry: CollectorRegistry, reads: TenantReads, configured: Collection[str] = ()
    ) -> None:
        self.configured = frozenset(configured)
        self.requests = Counter(
            "whoseturn_tenant_requests",
            "Tenant's requests, counted at their first token or their end",
            TENANT_CLASS,
            registry=registry,
        )
        self.wait = Histogram(
            "whoseturn_tenant_wait_seconds",
            "Tenant's time queued in the proxy",
            TENANT_CLASS,
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "whoseturn_tenant_ttft_seconds",
            "Tenant's arrival at the proxy to first token",
            TENANT_CLASS,
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.token_count = Counter(
            "whoseturn_tenant_tokens",
            "Tenant's tokens (engine usage)",
            [*TENANT_CLASS, "kind"],
            registry=registry,
        )
        self.refusals = Counter(
            "whoseturn_tenant_limited",
            "Tenant's requests refused (429) or batch lines held, by the limit reached",
            ["tenant", "limit"],
            registry=registry,
        )
        registry.register(TenantCollector(reads, self.label))
        for name in (*sorted(self.configured), OTHER_TENANT):
            self._create_children(name)

    def _create_children(self, label: str) -> None:
        """Counters start at 0, so that ``increase()`` sees a tenant's first event."""
        for c in TrafficClass:
            self.requests.labels(label, c.value)
            for kind in TENANT_TOKEN_KINDS:
                self.token_count.labels(label, c.value, kind)
        for limit in TENANT_LIMITS:
            self.refusals.labels(label, limit)

    def label(self, tenant: str) -> str:
        """A configured tenant's name; ``other`` for every other tenant."""
        return tenant if tenant in self.configured else OTHER_TENANT

    def request(
        self, tenant: str, cls: TrafficClass, *, waited_s: float, ttft_s: float | None
    ) -> None:
        """Once per request: at its first token (``ttft_s``) or at its end without
        one (None); ``waited_s`` is the time it was queued in the proxy."""
        label = self.label(tenant)
        self.requests.labels(label, cls.value).inc()
        self.wait.labels(label, cls.value).observe(waited_s)
        if ttft_s is not None:
            self.ttft.labels(label, cls.value).observe(ttft_s)

    def tokens(self, tenant: str, cls: TrafficClass, prompt: int, completion: int) -> None:
        """A request's tokens, from the engine's usage, at its end."""
        label = self.label(tenant)
        for kind, n in (("prompt", prompt), ("completion", completion)):
            if n > 0:
                self.token_count.labels(label, cls.value, kind).inc(n)

    def limited(self, tenant: str, limit: str) -> None:
        """A request refused with 429, or a batch line held, for ``limit`` (a
        :data:`TENANT_LIMITS` name)."""
        self.refusals.labels(self.label(tenant), limit).inc()


class ProxyRegistry(CollectorRegistry):
    """The app's registry, collected without the ``NAME_created`` series.

    prometheus_client gives every counter, histogram and summary a ``_created``
    series (when its child was made): docs/metrics.md lists none, and a scrape
    stores each one as a gauge of its own, one per label set. The library's own
    switch (``disable_created_metrics()``) is process-wide: it would change every
    other registry in the process too (an embedding app's, a test's). So they are
    left out here, for this registry only, as its families are collected.
    """

    def collect(self) -> Iterator[Metric]:
        """Every family of the registry, its ``_created`` samples left out."""
        for metric in super().collect():
            created = f"{metric.name}_created"
            if any(s.name == created for s in metric.samples):
                metric = copy.copy(metric)  # the collector's own object is left alone
                metric.samples = [s for s in metric.samples if s.name != created]
            yield metric


class ProxyMetrics:
    """Every family of docs/metrics.md, in its order, on a registry of the app's own."""

    def __init__(
        self,
        scheduler: Scheduler,
        ttft_target_s: float,
        gap_target_s: float = 0.1,
        engine_urls: Mapping[str, str] | None = None,
        tenant_names: Collection[str] = (),
    ) -> None:
        """``tenant_names``: the tenants the config names (their own label; every
        other tenant is ``other``)."""
        self.registry = ProxyRegistry(auto_describe=True)
        urls = engine_urls if engine_urls is not None else {}  # the fleet adds to it
        self.registry.register(SchedulerCollector(scheduler, urls))
        self.ledger = LedgerCollector()
        self.registry.register(self.ledger)
        self._request_path()
        self._targets(ttft_target_s, gap_target_s)
        self.batch = BatchMetrics()
        self.registry.register(self.batch)
        self.pieces = PieceMetrics(self.registry)
        self.tenants = TenantMetrics(self.registry, scheduler, tenant_names)
        self.cards = CardMetrics(self.registry)
        self._create_children(scheduler)

    def _request_path(self) -> None:
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
        self.prefix_cached = self._counter(
            "whoseturn_prefix_cached_tokens",
            "Prompt tokens found in the engine's prefix cache, of answers that report "
            "cached_tokens: expected by the proxy's index, or reported by the engine",
            ["engine", "source"],
        )
        self.prefix_prompt = self._counter(
            "whoseturn_prefix_prompt_tokens",
            "Prompt tokens of answers that report cached_tokens (the hit rate's whole)",
            ["engine"],
        )

    def _targets(self, ttft_target_s: float, gap_target_s: float) -> None:
        """The configured targets: constants, set once (interactive only)."""
        ttft = Gauge(
            "whoseturn_ttft_target_seconds",
            "Configured TTFT target",
            ["class"],
            registry=self.registry,
        )
        gap = Gauge(
            "whoseturn_inter_token_target_seconds",
            "Configured inter-token gap target (p95)",
            ["class"],
            registry=self.registry,
        )
        ttft.labels(TrafficClass.INTERACTIVE.value).set(ttft_target_s)
        gap.labels(TrafficClass.INTERACTIVE.value).set(gap_target_s)

    def _histogram(
        self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = CLASS_ENGINE
    ) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def _counter(self, name: str, doc: str, labels: Sequence[str] = CLASS_ENGINE) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def _create_children(self, scheduler: Scheduler) -> None:
        """Counters start at 0 for every known label set, so that ``increase()`` sees
        the first event too."""
        for engine in scheduler.engines:
            self.prefix_prompt.labels(engine)
            for source in ("expected", "reported"):
                self.prefix_cached.labels(engine, source)
        for c in TrafficClass:
            for engine in scheduler.engines:
                self.prompt_tokens.labels(c.value, engine)
                self.completion_tokens.labels(c.value, engine)
                for outcome in OUTCOMES:
                    self.requests.labels(c.value, engine, outcome)


# -- several workers of one box as one exposition (proxy.api.box) ------------------

WORKER_LABEL = "worker"
MISSING = "whoseturn_box_workers_missing"


def merge_expositions(parts: Sequence[tuple[str, bytes]], missing: Iterable[str] = ()) -> bytes:
    """Prometheus text expositions, one per worker (its name, its text), as one:
    each family once, with every worker's samples, each labelled ``worker``; and
    ``whoseturn_box_workers_missing{worker}`` 1 for each worker left out."""
    families: dict[str, Metric] = {}
    for worker, text in parts:
        for family in text_string_to_metric_families(text.decode("utf-8")):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for sample in family.samples:
                labels = {**sample.labels, WORKER_LABEL: worker}
                merged.add_sample(sample.name, labels, sample.value, sample.timestamp)
    gone = Metric(MISSING, "Workers of this box whose metrics this scrape lacks", "gauge")
    for worker in missing:
        gone.add_sample(MISSING, {WORKER_LABEL: worker}, 1.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*families.values(), gone]))
    return generate_latest(registry)


class _Families:
    """A collector that yields families already made."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return iter(self._families)
