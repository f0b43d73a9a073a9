"""The proxy's ASGI app: :func:`create_app` builds the routes; the lifespan builds
everything else from the settings (HTTP client, engine pool, scheduler, monitor,
metrics) and keeps it in one :class:`ProxyState`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.admission import Admission
from proxy.api.errors import install_error_handlers
from proxy.api.forward import Forwarder
from proxy.api.inputs import check_api_key
from proxy.api.status import install_status_route
from proxy.api.turn import install_turn_routes
from proxy.clock import Clock, WallClock
from proxy.config import EngineConfig, Settings
from proxy.engines import EngineMonitor, EnginePool, UpstreamError, make_http_client
from proxy.metrics import ProxyMetrics
from proxy.scheduler import (
    BudgetSettings,
    EngineSettings,
    Scheduler,
    SchedulerSettings,
    TrafficClass,
)

logger = logging.getLogger(__name__)
TICK_S = 0.05
DISCOVER_S = 1.0


@dataclass
class ProxyState:
    settings: Settings
    clock: Clock
    http: httpx.AsyncClient
    pool: EnginePool
    scheduler: Scheduler
    admission: Admission
    monitor: EngineMonitor
    metrics: ProxyMetrics
    forwarder: Forwarder
    created: int = field(default_factory=lambda: int(time.time()))
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


def engine_settings(cfg: EngineConfig, models: tuple[str, ...], s: Settings) -> EngineSettings:
    budget = BudgetSettings(
        initial_tokens=cfg.budget.initial_tokens,
        min_tokens=cfg.budget.min_tokens,
        max_tokens=cfg.budget.max_tokens,
        ttft_target_s=s.ttft_target_s,
        gap_target_s=s.gap_target_s,
    )
    return EngineSettings(
        name=cfg.name,
        models=frozenset(models),
        max_inflight=cfg.max_inflight,
        batch_max_inflight=cfg.batch_max_inflight,
        kv_high_watermark=cfg.kv_high_watermark,
        budget=budget,
    )


async def build_state(
    settings: Settings, transport: httpx.AsyncBaseTransport | None, clock: Clock
) -> ProxyState:
    http = make_http_client(settings, transport)
    pool = EnginePool(settings.engines, http)
    found = await pool.discover()
    engines = [
        engine_settings(c, c.models or found.get(c.name, ()), settings) for c in settings.engines
    ]
    for e in engines:
        logger.info("engine %s serves %s", e.name, sorted(e.models) or "nothing (unreachable?)")
    scheduler = Scheduler(
        engines, clock, SchedulerSettings(decision_log_size=settings.decision_log_size)
    )
    admission = Admission(scheduler)
    monitor = EngineMonitor(pool, admission, settings)
    urls = {c.name: c.url for c in settings.engines}
    metrics = ProxyMetrics(scheduler, settings.ttft_target_s, settings.gap_target_s, urls)
    forwarder = Forwarder(settings, admission, pool, monitor, metrics, clock)
    return ProxyState(
        settings, clock, http, pool, scheduler, admission, monitor, metrics, forwarder
    )


async def _tick(admission: Admission) -> None:
    """Keep turn accounting and the budget loops moving when no request does."""
    while True:
        await asyncio.sleep(TICK_S)
        admission.tick()


async def _discover_late(state: ProxyState) -> None:
    """Ask engines that were unreachable at start which models they serve."""
    while True:
        await asyncio.sleep(DISCOVER_S)
        for name, engine in state.scheduler.engines.items():
            if engine.settings.models or not state.monitor.up.get(name):
                continue
            try:
                models = await state.pool.client_for(name).models()
            except UpstreamError as exc:
                logger.warning("engine %s: model discovery failed: %s", name, exc)
                continue
            logger.info("engine %s serves %s", name, models)
            state.scheduler.set_engine_models(name, models)
            state.admission.pump()


def create_app(
    settings: Settings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    clock: Clock | None = None,
) -> FastAPI:
    """The proxy. ``transport`` replaces the upstream network (tests); ``clock`` the
    wall clock."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = await build_state(settings, transport, clock or WallClock())
        await state.monitor.check_once()
        state.tasks = [
            asyncio.create_task(state.monitor.run(), name="whoseturn-monitor"),
            asyncio.create_task(_tick(state.admission), name="whoseturn-tick"),
            asyncio.create_task(_discover_late(state), name="whoseturn-discover"),
        ]
        app.state.proxy = state
        try:
            yield
        finally:
            for task in state.tasks:
                task.cancel()
            for task in state.tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await state.http.aclose()

    app = FastAPI(title="whoseturn", lifespan=lifespan)
    install_error_handlers(app)
    _routes(app)
    install_turn_routes(app, lambda request: _state(request).admission)
    install_status_route(app)
    return app


def _state(request: Request) -> ProxyState:
    state: ProxyState = request.app.state.proxy
    return state


def _routes(app: FastAPI) -> None:
    def forward(path: str, cls: TrafficClass) -> None:
        async def handler(request: Request) -> Response:
            return await _state(request).forwarder.handle(request, path, cls)

        prefix = "/batch" if cls is TrafficClass.BATCH else ""
        app.add_api_route(prefix + path, handler, methods=["POST"], name=f"{cls}{path}")

    for path in ("/v1/chat/completions", "/v1/completions"):
        forward(path, TrafficClass.INTERACTIVE)
        forward(path, TrafficClass.BATCH)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        state = _state(request)
        check_api_key(request, state.settings)
        data = [
            {"id": m, "object": "model", "created": state.created, "owned_by": "whoseturn"}
            for m in state.scheduler.models()
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        monitor = _state(request).monitor
        up = [n for n, ok in monitor.up.items() if ok and monitor.failures[n] == 0]
        ready = monitor.health_rounds > 0 and bool(up)
        return JSONResponse({"ready": ready, "engines_up": up}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state = _state(request)
        state.admission.tick()
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
