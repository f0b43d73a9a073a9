"""The composition root: every part of the proxy built from its settings, and their
lifecycle.

- **startup** (:func:`startup`): one HTTP client for all engines, the engine pool,
  the models each engine serves (configured, else asked), the scheduler, the
  admission in front of it, the engine monitor, the metrics, the prompt counter,
  the tenants' limits (:class:`~proxy.scheduler.limits.TenantMeter`, reached as
  ``services.meter``) and the forwarder; then one round of health checks and load
  scrapes, and the background loops.
- **run**: the engine monitor (health, load scrapes), the tick loop (turn
  accounting and the budget loops move on when no request does; it may dispatch)
  late model discovery for engines that were unreachable at start or joined later,
  DNS discovery of engine groups (``dns+http://`` URLs: engines join and leave,
  :mod:`proxy.engines._discovery`), the shared budget's ledger loop when several
  replicas share the engines (:mod:`proxy.replicas`), and the batch runner.
- **shutdown** (:func:`shutdown`): the loops are cancelled and awaited, then the
  HTTP client is closed.

The app (:func:`create_app`) is put together here too: the HTTP edge's routes
(:mod:`proxy.api.routes`) and the Batch API's (:mod:`proxy.batch.routes`) on one
FastAPI app whose lifespan is :func:`running`.

Nothing is built at import time; the state lives in one :class:`ProxyState`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
from fastapi import FastAPI, Request
from fastapi.telemetry import TelemetryConfig

from proxy.admission import Admission
from proxy.api.box import Box
from proxy.api.docs import publish_as_written
from proxy.api.forward import Forwarder
from proxy.api.front import EdgeApp
from proxy.api.piece_sender import PieceSender
from proxy.api.prompts import PromptCounter
from proxy.api.relay import ReadTimeouts, Services
from proxy.api.routes import install_api
from proxy.batch import BatchAPI, build_batch, install_batch_routes
from proxy.batch.routes import FORM_SLACK_BYTES
from proxy.cards import CardKeeper, build_cards
from proxy.clock import Clock, WallClock
from proxy.config import Activation, EngineConfig, Settings
from proxy.engines import (
    Activator,
    EngineDiscovery,
    EngineMonitor,
    EnginePool,
    PlainHTTPTransport,
    PrefixFeed,
    Resolver,
    UpstreamError,
    engine_transport,
    make_http_client,
    resolve_addresses,
)
from proxy.metrics import ProxyMetrics
from proxy.replicas import Ledger, SharedBudget
from proxy.scheduler import HoldRules, Scheduler, SchedulerSettings
from proxy.scheduler.limits import TenantMeter

logger = logging.getLogger(__name__)
TICK_S = 0.05
DISCOVER_S = 1.0


@dataclass
class ProxyState:
    """The running proxy's parts, built once by :func:`build`."""

    settings: Settings
    clock: Clock
    http: httpx.AsyncClient
    pool: EnginePool
    scheduler: Scheduler
    admission: Admission
    monitor: EngineMonitor
    metrics: ProxyMetrics
    counter: PromptCounter
    forwarder: Forwarder
    discovery: EngineDiscovery
    prefix_feed: PrefixFeed
    shared: SharedBudget | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    batch: BatchAPI | None = None
    replica: str = ""  # this proxy's name in the ledger (and on /turn)
    box: Box | None = None  # this proxy is one of a box's workers (serve --workers)
    cards: list[CardKeeper] = field(default_factory=list)  # models sharing a card

    def batch_store_health(self, now: float) -> dict[str, Any] | None:
        """The batch store's health at monotonic time ``now`` (``/readyz``); None
        while the Batch API is off."""
        return None if self.batch is None else self.batch.store.health.view(now)


async def _engines(settings: Settings, pool: EnginePool) -> list[EngineConfig]:
    """The configured engines, each with the models it serves (asked where not set)."""
    found = await pool.discover()
    engines = [
        dataclasses.replace(c, models=tuple(c.models or found.get(c.name, ())))
        for c in settings.engines
        if not c.by_dns
    ]
    for e in engines:
        logger.info("engine %s serves %s", e.name, sorted(e.models) or "nothing (unreachable?)")
    return engines


@dataclass
class Fleet:
    """Engines joining and leaving (DNS discovery), told to every part that keeps one
    entry per engine."""

    pool: EnginePool
    monitor: EngineMonitor
    admission: Admission
    urls: dict[str, str]
    piece_sender: PieceSender
    prefix_feed: PrefixFeed

    def join(self, config: EngineConfig) -> None:
        self.pool.add(config)
        self.monitor.add(config.name)
        self.urls[config.name] = config.url
        self.piece_sender.add(config)
        self.admission.add_engine(config)
        self.prefix_feed.add(config)

    def leave(self, name: str) -> None:
        self.admission.drain_engine(name)

    def forget(self, name: str) -> bool:
        if not self.admission.remove_engine(name):
            return False
        self.monitor.remove(name)
        self.pool.remove(name)
        self.urls.pop(name, None)
        self.piece_sender.remove(name)
        self.prefix_feed.remove(name)
        return True


def default_replica_id() -> str:
    """A replica's name when ``replica_id`` is unset: host name, pid, random suffix."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid4().hex[:6]}"


def _shared_budget(
    settings: Settings,
    admission: Admission,
    pool: EnginePool,
    ledger: Ledger | None,
    replica: str,
) -> SharedBudget | None:
    """The shared budget of several replicas: on ``ledger`` if given (tests), else on
    PostgreSQL at ``ledger_dsn`` or in the SQLite file at ``ledger_path``; None
    without any (one replica alone)."""
    s = settings.replicas
    if ledger is None and s.ledger_dsn:
        from proxy.replicas.postgres import PostgresLedger  # psycopg loads only when used

        ledger = PostgresLedger(
            s.ledger_dsn, replica, lease_s=s.ledger_lease_s, timeout_s=s.ledger_timeout_s
        )
    elif ledger is None and s.ledger_path:
        from proxy.replicas.sqlite import SQLiteLedger

        ledger = SQLiteLedger(
            Path(s.ledger_path), replica, lease_s=s.ledger_lease_s, timeout_s=s.ledger_timeout_s
        )
    if ledger is None:
        return None

    def url_of(name: str) -> str | None:
        engine = pool.engines.get(name)
        return engine.url if engine is not None else None

    shared = SharedBudget(
        ledger,
        admission,
        url_of,
        interval_s=settings.replicas.ledger_interval_s,
        timeout_s=settings.replicas.ledger_timeout_s,
        lease_s=settings.replicas.ledger_lease_s,
    )
    admission.on_release = shared.nudge
    return shared


def _scheduler_settings(settings: Settings) -> SchedulerSettings:
    return SchedulerSettings(
        decision_log_size=settings.serving.decision_log_size,
        route_by=settings.serving.route_by,
        fair_share=settings.serving.fair_share,
        abort_limit=settings.sharing.batch_abort_max,
        hold=HoldRules(
            hold_timeout_s=settings.sharing.hold_timeout_s,
            batch_min_share=settings.sharing.batch_min_share,
        ),
    )


def _piece_sender(
    settings: Settings, pool: EnginePool, admission: Admission, clock: Clock, metrics: ProxyMetrics
) -> PieceSender:
    """Long prompts sent in pieces, aimed at a share of the chat targets."""
    aim = settings.engines[0].budget.aim if settings.engines else 0.8
    targets = settings.serving
    return PieceSender(
        list(settings.engines), pool, admission, clock, metrics.pieces,
        target_s=aim * targets.gap_target_s, idle_target_s=aim * targets.ttft_target_s,
    )  # fmt: skip


async def build(
    settings: Settings,
    transport: httpx.AsyncBaseTransport | None,
    clock: Clock,
    resolver: Resolver = resolve_addresses,
    ledger: Ledger | None = None,
) -> ProxyState:
    """Every part, wired; nothing runs yet. ``transport`` replaces the network,
    ``resolver`` the DNS and ``ledger`` the shared budget's store (tests)."""
    upstream = transport if transport is not None else engine_transport(settings)
    http = make_http_client(settings, upstream)
    direct = upstream if isinstance(upstream, PlainHTTPTransport) else None
    pool = EnginePool([c for c in settings.engines if not c.by_dns], http, direct)
    scheduler = Scheduler(await _engines(settings, pool), clock, _scheduler_settings(settings))
    admission = Admission(scheduler)
    monitor = EngineMonitor(pool, admission, settings)
    urls = {c.name: c.url for c in settings.engines if not c.by_dns}
    metrics = ProxyMetrics(
        scheduler,
        settings.serving.ttft_target_s,
        settings.serving.gap_target_s,
        urls,
        tenant_names=settings.access.tenant_names(),
    )
    piece_sender = _piece_sender(settings, pool, admission, clock, metrics)
    a = admission
    prefix_feed = PrefixFeed(pool, a.set_cache, a.follow_events, a.kv_events)
    for config in settings.engines:
        if not config.by_dns:
            prefix_feed.add(config)
    fleet = Fleet(pool, monitor, admission, urls, piece_sender, prefix_feed)
    discovery = EngineDiscovery(settings.engines, resolver, fleet)
    await discovery.resolve_once()
    counter = PromptCounter(pool, admission.engines_up_for, blocks=admission)
    timeouts = ReadTimeouts(
        settings.upstream.first_byte_timeout_s, settings.upstream.idle_timeout_s
    )
    meter = TenantMeter(clock)  # the tenants' limits: the edge's, the batch runner's
    services = Services(admission, metrics, clock, counter, timeouts, meter)
    replica = settings.replicas.replica_id or default_replica_id()
    shared = _shared_budget(settings, admission, pool, ledger, replica)
    reserve = None
    if shared is not None:
        metrics.ledger.attach(shared)
        reserve = shared.reserve
    forwarder = Forwarder(settings, pool, monitor, services, piece_sender, reserve)
    admission.on_abort = forwarder.abort
    state = ProxyState(
        settings, clock, http, pool, scheduler, admission, monitor, metrics, counter, forwarder,
        discovery, prefix_feed, shared, replica=replica,
    )  # fmt: skip
    await _discover_models(state)
    state.batch = await build_batch(
        settings,
        forwarder.complete,
        metrics,
        lambda: not admission.engines_without_models(),
        meter=meter,  # a job's lines count against its tenant's limits with its requests
    )
    runner = state.batch.runner if state.batch is not None else None
    state.cards = build_cards(
        settings.cards,
        settings.engines,
        lambda e: Activator(pool.client_for(e.name), _activation(e)),
        admission,
        monitor,
        clock,
        metrics.cards,
        runner.due if runner is not None else None,
    )
    if state.cards:
        keepers = state.cards

        def nudge(model: str) -> None:
            for keeper in keepers:
                keeper.nudge(model)

        admission.on_wake_wanted = nudge
    return state


def _activation(engine: EngineConfig) -> Activation:
    assert engine.activation is not None, "an engine on a card says how it is woken (load checks)"
    return engine.activation


async def _tick(admission: Admission) -> None:
    """Keep turn accounting and the budget loops moving when no request does."""
    while True:
        await asyncio.sleep(TICK_S)
        admission.tick()


async def _discover_late(state: ProxyState) -> None:
    """Ask engines that were unreachable at start, or joined since, which models
    they serve."""
    while True:
        await asyncio.sleep(DISCOVER_S)
        await _discover_models(state)
        await state.prefix_feed.shape()


async def _discover_models(state: ProxyState) -> None:
    for name in state.admission.engines_without_models():
        if not state.monitor.up.get(name) or name not in state.pool.engines:
            continue
        try:
            models = await state.pool.client_for(name).models()
        except UpstreamError as exc:
            logger.warning("engine %s: model discovery failed: %s", name, exc)
            continue
        logger.info("engine %s serves %s", name, models)
        state.admission.set_engine_models(name, models)


async def startup(state: ProxyState) -> None:
    """One round of health checks and load scrapes (and the shared ledger opened and
    read), then the background loops."""
    for keeper in state.cards:  # before the first health checks: a sleeping engine
        await keeper.start()  # is not ejected
    await state.monitor.check_once()
    await state.forwarder.piece_sender.discover()
    await state.prefix_feed.shape()
    state.prefix_feed.start()
    if state.shared is not None:
        await state.shared.ledger.open()
        await state.shared.sync_once()
        state.tasks.append(asyncio.create_task(state.shared.run(), name="whoseturn-ledger"))
    state.tasks += [
        asyncio.create_task(state.monitor.run(), name="whoseturn-monitor"),
        asyncio.create_task(_tick(state.admission), name="whoseturn-tick"),
        asyncio.create_task(_discover_late(state), name="whoseturn-discover"),
    ]
    if state.discovery.groups:
        interval = state.settings.upstream.dns_interval_s
        task = asyncio.create_task(state.discovery.run(interval), name="whoseturn-dns")
        state.tasks.append(task)
    for keeper in state.cards:
        state.tasks.append(asyncio.create_task(keeper.run(), name=f"whoseturn-card-{keeper.name}"))
    if state.batch is not None:
        state.tasks += [
            asyncio.create_task(state.batch.store.watch(), name="whoseturn-batch-store"),
            asyncio.create_task(state.batch.runner.run(), name="whoseturn-batch"),
        ]


async def shutdown(state: ProxyState) -> None:
    """Stop the background loops, then close the batch store, the ledger and the
    upstream HTTP client: each of them, whatever the others do (a loop that died
    with an error is logged, not raised again)."""
    await state.prefix_feed.stop()
    for task in state.tasks:
        task.cancel()
    for task in state.tasks:
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception:
            logger.exception("%s had ended with an error", task.get_name())
    closers: list[tuple[str, Callable[[], Awaitable[None]]]] = []
    for keeper in state.cards:
        closers.append((f"card {keeper.name}'s engines", keeper.close))
    if state.batch is not None:
        closers.append(("the batch store", state.batch.store.close))
    if state.shared is not None:
        closers.append(("the ledger", state.shared.ledger.close))
    closers.append(("the HTTP client", state.http.aclose))
    for what, close in closers:
        try:
            await close()
        except Exception:
            logger.exception("closing %s failed", what)


@asynccontextmanager
async def running(
    settings: Settings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    clock: Clock | None = None,
    resolver: Resolver = resolve_addresses,
    ledger: Ledger | None = None,
) -> AsyncIterator[ProxyState]:
    """The proxy from startup to shutdown, around the block."""
    state = await build(settings, transport, clock or WallClock(), resolver, ledger)
    try:
        await startup(state)
        yield state
    finally:
        await shutdown(state)


def create_app(
    settings: Settings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    clock: Clock | None = None,
    resolver: Resolver = resolve_addresses,
    ledger: Ledger | None = None,
    box: Box | None = None,
) -> FastAPI:
    """The proxy. ``transport`` replaces the upstream network (tests); ``clock`` the
    wall clock; ``resolver`` the DNS look-ups of engine groups; ``ledger`` the shared
    budget's store (else PostgreSQL at ``ledger_dsn`` or SQLite at ``ledger_path``,
    if set); ``box``: this is one of a box's worker processes. Its lifespan runs
    :func:`running`, and keeps the state in ``app.state.proxy``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with running(
            settings, transport=transport, clock=clock, resolver=resolver, ledger=ledger
        ) as state:
            state.box = box
            app.state.proxy = state
            yield

    # FastAPI's OpenTelemetry bridge is off: the proxy exports its own Prometheus
    # metrics, and the bridge asks OpenTelemetry for its providers on every request
    # (~5 % of a request's CPU, docs/overhead.md).
    off: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}
    app = EdgeApp(title="whoseturn", lifespan=lifespan, telemetry=off)
    # An upload to the Files API has its own, larger limit (the route checks it too).
    uploads = {
        "/v1/files": max(
            settings.edge.max_body_bytes, settings.batch.max_file_bytes + FORM_SLACK_BYTES
        )
    }
    install_api(app, settings, _state, uploads)
    install_batch_routes(app, lambda request: _state(request).batch)
    publish_as_written(app)
    return app


def _state(request: Request) -> ProxyState:
    state: ProxyState = request.app.state.proxy
    return state
