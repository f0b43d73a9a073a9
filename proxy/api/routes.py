"""The HTTP edge on an app that the composition root makes (:func:`proxy.server.create_app`):
:func:`install_api` adds OpenAI's error shape for every error, the API key check, the
body guard, HEAD as GET, and the edge's routes: the completion routes (and their
``/batch`` twins), ``/v1/models``, the probes, ``/metrics``, ``/turn`` and the status
page. Handlers reach the running proxy through ``state_of`` (:mod:`proxy.api.state`).
Reads (``/metrics``, ``/turn``, ``/turn/log``, ``/status``, ``/v1/models``, the
probes) never run the scheduler."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.api.auth import KeyCheck
from proxy.api.body_limits import BodyLimits
from proxy.api.box import box_metrics
from proxy.api.docs import Health, ModelList, Readiness, completion_route_docs, error_responses
from proxy.api.error_handlers import install_error_handlers
from proxy.api.front import EdgeApp, completion_endpoint
from proxy.api.intake import Intake
from proxy.api.methods import HeadAsGet
from proxy.api.piece_sender import PieceChoice
from proxy.api.state import StateOf
from proxy.api.status import install_status_route
from proxy.api.turn import install_turn_routes
from proxy.config import Settings
from proxy.scheduler import TrafficClass


def install_api(
    app: EdgeApp, settings: Settings, state_of: StateOf, path_limits: Mapping[str, int]
) -> None:
    """The edge's middleware, error handlers and routes on ``app``; ``path_limits``
    gives the paths whose bodies may be larger than ``max_body_bytes`` (the Files
    API's uploads) their own limit. The completion routes are answered in front of
    FastAPI's stack by the same layers (:mod:`proxy.api.front`)."""
    install_error_handlers(app)
    app.add_middleware(KeyCheck, settings=settings)
    limits = BodyLimits(
        max_body_bytes=settings.edge.max_body_bytes,
        path_limits=path_limits,
        body_timeout_s=settings.edge.body_timeout_s,
        max_body_bytes_in_flight=settings.edge.max_body_bytes_in_flight,
    )
    app.add_middleware(Intake, limits=limits)
    app.add_middleware(HeadAsGet, routes=app.router.routes)  # outermost: HEAD runs as GET
    endpoint = completion_endpoint(lambda request: state_of(request).forwarder)
    app.answer_completions_first(Intake(KeyCheck(endpoint, settings=settings), limits))
    _completion_routes(app, state_of)
    _read_routes(app, state_of)
    _turn_routes(app, state_of)
    install_status_route(app)


def _turn_routes(app: FastAPI, state_of: StateOf) -> None:
    def piece_choices(request: Request, limit: int) -> list[PieceChoice]:
        return state_of(request).forwarder.piece_sender.choices(limit)

    def piece_facts(request: Request) -> dict[str, dict[str, object]] | None:
        return state_of(request).forwarder.piece_sender.report()

    def ledger_state(request: Request) -> dict[str, Any] | None:
        shared = state_of(request).shared
        return None if shared is None else shared.report()

    install_turn_routes(
        app,
        lambda request: state_of(request).admission,
        piece_facts,
        lambda request: state_of(request).replica,
        piece_choices,
        ledger_state,
        lambda request: state_of(request).monitor,
        lambda request: state_of(request).box,
        lambda request: state_of(request).cards,
    )


METRICS_DOC: dict[int | str, dict[str, object]] = {
    200: {
        "description": "Prometheus text exposition format.",
        "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
    },
    **error_responses(401),
}


def _completion_routes(app: FastAPI, state_of: StateOf) -> None:
    """The completion routes in FastAPI's router, for the OpenAPI document and the 405
    that another method gets; a ``POST`` is answered in front (:mod:`proxy.api.front`)."""

    def forward(path: str, cls: TrafficClass) -> None:
        async def handler(request: Request) -> Response:
            return await state_of(request).forwarder.handle(request, path, cls)

        prefix = "/batch" if cls is TrafficClass.BATCH else ""
        docs = completion_route_docs(chat=path.endswith("/chat/completions"))
        app.add_api_route(prefix + path, handler, methods=["POST"], name=f"{cls}{path}", **docs)

    for path in ("/v1/chat/completions", "/v1/completions"):
        forward(path, TrafficClass.INTERACTIVE)
        forward(path, TrafficClass.BATCH)


def _read_routes(app: FastAPI, state_of: StateOf) -> None:
    @app.get("/v1/models", response_model=ModelList, responses=error_responses(401))
    @app.get("/batch/v1/models", response_model=ModelList, responses=error_responses(401))
    async def models(request: Request) -> JSONResponse:
        state = state_of(request)  # the key was checked as the request came in (KeyCheck)
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
        state = state_of(request)
        monitor = state.monitor
        up = [n for n, ok in monitor.up.items() if ok and monitor.failures[n] == 0]
        ready = monitor.health_rounds > 0 and bool(up)
        body = {
            "ready": ready,
            "engines_up": up,
            "batch_store": state.batch_store_health(time.monotonic()),
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics", responses=METRICS_DOC)
    async def metrics(request: Request) -> Response:
        """A read: the scheduler's gauges are read as they stand, nothing runs. One
        of a box's workers answers for the box (:mod:`proxy.api.box`), unless asked
        for its own (``?scope=worker``)."""
        state = state_of(request)
        own = generate_latest(state.metrics.registry)
        if state.box is not None and request.query_params.get("scope") != "worker":
            authorization = request.headers.get("authorization")
            own = await box_metrics(state.box, own, authorization)
        return Response(own, media_type=CONTENT_TYPE_LATEST)
