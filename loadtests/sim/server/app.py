"""The simulated engine's HTTP server: vLLM's OpenAI-compatible routes and lifecycle.

:func:`create_sim_app` builds nothing but the routes; the engine, its clock, the
metrics registry, the driver task, the request log (``--request-log``, if given) and
the KV-event publisher (``--kv-events-config``, if enabled) are made in the lifespan
from the settings and kept in one :class:`SimState`. On shutdown (after uvicorn has
drained the open requests) whatever is still in the engine is aborted, the driver is
cancelled and the publisher sends what it has queued and closes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from loadtests.sim.kv_events import EventPublisher, create_publisher
from loadtests.sim.server.errors import bad_request, install_error_handlers, model_not_found
from loadtests.sim.server.inputs import chat_prompt_ids, completion_prompt_ids, engine_input
from loadtests.sim.server.loop import StepDriver
from loadtests.sim.server.metrics import SimMetrics
from loadtests.sim.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    TokenizeRequest,
)
from loadtests.sim.server.requestlog import RequestLog, RequestLogMiddleware
from loadtests.sim.server.responses import (
    ChatRenderer,
    CompletionRenderer,
    Renderer,
    ResponseMeta,
    random_request_id,
)
from loadtests.sim.server.sleep import SleepMode, install_sleep_routes
from loadtests.sim.server.streaming import (
    EventStreamResponse,
    answer_text,
    collect,
    request_usage,
    sse_events,
)
from loadtests.sim.settings import SimSettings
from loadtests.sim.step_loop import SimEngine
from proxy.clock import WallClock

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"


@dataclass
class SimState:
    """Everything one running server holds."""

    settings: SimSettings
    clock: WallClock
    engine: SimEngine
    metrics: SimMetrics
    driver: StepDriver
    created: int = field(default_factory=lambda: int(time.time()))
    driver_task: asyncio.Task[None] | None = None
    request_log: RequestLog | None = None
    kv_events: EventPublisher | None = None
    sleep: SleepMode | None = None

    @classmethod
    def build(cls, settings: SimSettings) -> SimState:
        clock = WallClock(settings.time_scale)
        kv_events = create_publisher(settings.kv_events)
        engine = SimEngine(settings.scheduler, settings.profile.step, clock, kv_events=kv_events)
        metrics = SimMetrics(settings.served_model_name, settings.scheduler)
        metrics.update_gauges(engine)
        driver = StepDriver(engine, clock, metrics)
        sleep = SleepMode(engine, clock, settings.profile.activation)
        return cls(settings, clock, engine, metrics, driver, kv_events=kv_events, sleep=sleep)

    @property
    def model(self) -> str:
        return self.settings.served_model_name

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model:
            raise model_not_found(name)


def _state(request: Request) -> SimState:
    state = request.app.state.sim
    assert isinstance(state, SimState)
    return state


State = Annotated[SimState, Depends(_state)]


def _sleep_mode(request: Request) -> SleepMode:
    mode = _state(request).sleep
    assert mode is not None
    return mode


# -- generation ----------------------------------------------------------------


def _base_request_id(request: Request, body: GenerationRequest) -> str:
    return request.headers.get(REQUEST_ID_HEADER) or body.request_id or random_request_id()


async def chat_completions(body: ChatCompletionRequest, request: Request, state: State) -> Response:
    state.check_model(body.model)
    prompt_ids = chat_prompt_ids(state.engine.tokenizer, body.messages)
    return await _generate(state, request, body, prompt_ids, ChatRenderer, "chatcmpl")


async def completions(body: CompletionRequest, request: Request, state: State) -> Response:
    state.check_model(body.model)
    prompt_ids = completion_prompt_ids(state.engine.tokenizer, body.prompt)
    return await _generate(state, request, body, prompt_ids, CompletionRenderer, "cmpl")


async def _generate(
    state: SimState,
    request: Request,
    body: GenerationRequest,
    prompt_ids: list[int],
    render_with: Callable[[ResponseMeta], Renderer],
    id_prefix: str,
) -> Response:
    """Run one request in the engine and answer it, streamed or whole; the answer's
    id is ``ID_PREFIX-`` and the request id (the caller's, or a fresh one)."""
    if state.sleep is not None:
        state.sleep.check_serving()
    base_id = _base_request_id(request, body)
    renderer = render_with(ResponseMeta(id=f"{id_prefix}-{base_id}", model=state.model))
    inputs = engine_input(body, prompt_ids, state.settings.scheduler)
    try:
        stream = state.driver.submit(
            inputs.prompt_token_ids,
            inputs.max_tokens,
            request_id=renderer.meta.id,
            priority=inputs.priority,
            seed=inputs.seed,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from exc
    headers = {REQUEST_ID_HEADER: base_id}
    decode = state.engine.tokenizer.decode_token
    details = state.settings.enable_prompt_tokens_details
    if body.stream:
        include = body.include_usage
        events = sse_events(stream, renderer, decode, include_usage=include, details=details)
        return EventStreamResponse(events, stream, headers=headers)
    tokens = await collect(request, stream)
    if tokens is None:
        return Response(status_code=499)  # nobody is listening any more
    finish = stream.request.finish_reason
    body_json = renderer.body(
        answer_text(tokens, decode), finish, request_usage(stream.request, details)
    )
    return JSONResponse(body_json, headers=headers)


# -- the rest of vLLM's surface ---------------------------------------------------


async def tokenize(body: TokenizeRequest, state: State) -> JSONResponse:
    state.check_model(body.model)
    tokenizer = state.engine.tokenizer
    if body.messages is not None:
        ids = chat_prompt_ids(tokenizer, body.messages)
    else:
        ids = tokenizer.encode(body.prompt or "")
    max_model_len = state.settings.scheduler.max_model_len
    return JSONResponse(
        {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}
    )


async def list_models(state: State) -> JSONResponse:
    card: dict[str, Any] = {
        "id": state.model,
        "object": "model",
        "created": state.created,
        "owned_by": "vllm",
        "root": state.model,
        "parent": None,
        "max_model_len": state.settings.scheduler.max_model_len,
    }
    return JSONResponse({"object": "list", "data": [card]})


async def health(state: State) -> Response:
    task = state.driver_task
    alive = task is not None and not task.done()
    return Response(status_code=200 if alive else 503)


async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


# -- lifecycle ---------------------------------------------------------------------


def _report_driver_exit(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("engine loop died; /health now answers 503", exc_info=task.exception())


@asynccontextmanager
async def _lifespan(app: FastAPI, settings: SimSettings) -> AsyncIterator[None]:
    state = SimState.build(settings)
    if settings.request_log is not None:
        state.request_log = RequestLog(settings.request_log)
    app.state.sim = state
    task = asyncio.create_task(state.driver.run(), name="whoseturn-sim-driver")
    task.add_done_callback(_report_driver_exit)
    state.driver_task = task
    logger.info(
        "simulated engine up: model %s, profile %s, time scale %g",
        settings.served_model_name,
        settings.profile.name,
        settings.time_scale,
    )
    try:
        yield
    finally:
        left = state.driver.abort_all()
        if left:
            logger.warning("shutting down: aborted %d requests still in the engine", left)
        task.cancel()
        await asyncio.wait({task})
        if state.request_log is not None:
            state.request_log.close()
        if state.kv_events is not None:
            state.kv_events.shutdown()


def _lifespan_for(settings: SimSettings) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    def lifespan(app: FastAPI) -> AbstractAsyncContextManager[None]:
        return _lifespan(app, settings)

    return lifespan


def create_sim_app(settings: SimSettings) -> FastAPI:
    """The simulated engine as an ASGI app; nothing is built until its lifespan starts."""
    app = FastAPI(title="whoseturn simulated engine", lifespan=_lifespan_for(settings))
    install_error_handlers(app)
    if settings.request_log is not None:
        app.add_middleware(RequestLogMiddleware)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    install_sleep_routes(app, _sleep_mode)
    return app


def run_sim_server(settings: SimSettings) -> int:
    """Run the server until interrupted; returns the process exit code.

    Ctrl-C (SIGINT) drains open requests for up to 5 s and returns 0. On SIGTERM
    uvicorn drains the same way, then re-raises the signal (exit status 143).
    """
    config = uvicorn.Config(
        create_sim_app(settings),
        host=settings.host,
        port=settings.port,
        log_config=None,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it has handled
        pass
    except SystemExit as exc:  # uvicorn exits when it cannot bind the port
        return exc.code if isinstance(exc.code, int) else 1
    return 0 if server.started else 1
