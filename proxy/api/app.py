"""The proxy's HTTP edge: :func:`create_app` installs the routes; its lifespan runs
the composition root (:mod:`proxy.server`), which builds and runs everything else
and keeps it in one :class:`~proxy.server.ProxyState`. Reads (``/metrics``,
``/turn``, ``/turn/log``, ``/status``, ``/v1/models``, the probes) never run the
scheduler."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.telemetry import TelemetryConfig
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.api.auth import KeyGuard
from proxy.api.docs import (
    Health,
    ModelList,
    Readiness,
    completion_route_docs,
    error_responses,
    publish_as_written,
)
from proxy.api.errors import install_error_handlers
from proxy.api.guard import Guard
from proxy.api.inputs import check_api_key
from proxy.api.methods import HeadAsGet
from proxy.api.pieces import PieceChoice
from proxy.api.status import install_status_route
from proxy.api.turn import install_turn_routes
from proxy.batch import install_batch_routes
from proxy.batch.routes import FORM_SLACK_BYTES
from proxy.clock import Clock
from proxy.config import Settings
from proxy.engines import Resolver, resolve_addresses
from proxy.replicas import Ledger
from proxy.scheduler import TrafficClass
from proxy.server import ProxyState, running


def create_app(
    settings: Settings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    clock: Clock | None = None,
    resolver: Resolver = resolve_addresses,
    ledger: Ledger | None = None,
) -> FastAPI:
    """The proxy. ``transport`` replaces the upstream network (tests); ``clock`` the
    wall clock; ``resolver`` the DNS look-ups of engine groups; ``ledger`` the shared
    budget's store (else PostgreSQL at ``ledger_dsn``, if set). Its lifespan runs
    :func:`proxy.server.running`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with running(
            settings, transport=transport, clock=clock, resolver=resolver, ledger=ledger
        ) as state:
            app.state.proxy = state
            yield

    # FastAPI's OpenTelemetry bridge is off: the proxy exports its own Prometheus
    # metrics, and the bridge asks OpenTelemetry for its providers on every request
    # (~5 % of a request's CPU, docs/overhead.md).
    off: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="whoseturn", lifespan=lifespan, telemetry=off)
    install_error_handlers(app)
    app.add_middleware(KeyGuard, settings=settings)
    # An upload to the Files API has its own, larger limit (the route checks it too).
    uploads = {
        "/v1/files": max(settings.max_body_bytes, settings.batch_max_file_bytes + FORM_SLACK_BYTES)
    }
    app.add_middleware(
        Guard,
        max_body_bytes=settings.max_body_bytes,
        path_limits=uploads,
        body_timeout_s=settings.body_timeout_s,
        max_body_bytes_in_flight=settings.max_body_bytes_in_flight,
    )
    app.add_middleware(HeadAsGet, routes=app.router.routes)  # outermost: HEAD runs as GET
    _routes(app)
    install_turn_routes(
        app,
        lambda request: _state(request).admission,
        _piece_facts,
        lambda request: _state(request).replica,
        _piece_choices,
        _ledger_state,
    )
    install_status_route(app)
    install_batch_routes(app, lambda request: _state(request).batch)
    publish_as_written(app)
    return app


def _piece_choices(request: Request, limit: int) -> list[PieceChoice]:
    pieces = _state(request).forwarder.pieces
    return [] if pieces is None else pieces.choices(limit)


def _piece_facts(request: Request) -> dict[str, dict[str, object]] | None:
    pieces = _state(request).forwarder.pieces
    return None if pieces is None else pieces.report()


def _ledger_state(request: Request) -> dict[str, Any] | None:
    shared = _state(request).shared
    return None if shared is None else shared.report()


METRICS_DOC: dict[int | str, dict[str, object]] = {
    200: {
        "description": "Prometheus text exposition format.",
        "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
    },
    **error_responses(401),
}


def _state(request: Request) -> ProxyState:
    state: ProxyState = request.app.state.proxy
    return state


def _routes(app: FastAPI) -> None:
    def forward(path: str, cls: TrafficClass) -> None:
        async def handler(request: Request) -> Response:
            return await _state(request).forwarder.handle(request, path, cls)

        prefix = "/batch" if cls is TrafficClass.BATCH else ""
        docs = completion_route_docs(chat=path.endswith("/chat/completions"))
        app.add_api_route(prefix + path, handler, methods=["POST"], name=f"{cls}{path}", **docs)

    for path in ("/v1/chat/completions", "/v1/completions"):
        forward(path, TrafficClass.INTERACTIVE)
        forward(path, TrafficClass.BATCH)

    @app.get("/v1/models", response_model=ModelList, responses=error_responses(401))
    @app.get("/batch/v1/models", response_model=ModelList, responses=error_responses(401))
    async def models(request: Request) -> JSONResponse:
        state = _state(request)
        check_api_key(request, state.settings)
        data = [
            {"id": m, "object": "model", "created": state.created, "owned_by": "whoseturn"}
            for m in state.admission.models()
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.get(
        "/healthz", response_model=Health, responses={200: {"description": "The proxy is alive."}}
    )
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
    async def readyz(request: Request) -> JSONResponse:
        state = _state(request)
        monitor = state.monitor
        up = [n for n, ok in monitor.up.items() if ok and monitor.failures[n] == 0]
        ready = monitor.health_rounds > 0 and bool(up)
        body = {"ready": ready, "engines_up": up, "batch_store": None}
        if state.batch is not None:
            body["batch_store"] = state.batch.store.health.view(time.monotonic())
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics", responses=METRICS_DOC)
    async def metrics(request: Request) -> Response:
        """A read: the scheduler's gauges are read as they stand, nothing runs."""
        registry = _state(request).metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
