"""Forwarding one OpenAI request: read it, wait for its turn, stream it from an engine.

Every upstream call streams (the scheduler must see the first token). A client
that asked for a stream gets the engine's events relayed byte for byte as they
complete; one that asked for a body gets it assembled from them. Hang-ups abort
at once: while queued the job leaves the queue, while running the upstream
response is closed, which makes the engine abort the request.

Failures before the client has received a byte are retried on another engine
serving the model (a non-streaming answer counts as not yet received until it is
whole); a stream that breaks after bytes went out ends with an SSE error event.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from proxy.admission import Admission
from proxy.api.assemble import Assembler
from proxy.api.errors import engine_failed, engine_unavailable, model_not_found
from proxy.api.inputs import (
    TokenEstimator,
    affinity_key,
    check_api_key,
    prompt_text,
    read_json,
    stream_wish,
    traffic_class,
    upstream_body,
)
from proxy.api.relay import Relay
from proxy.api.sse import sse_error
from proxy.clock import Clock
from proxy.config import Settings
from proxy.engines import (
    EngineHTTPError,
    EngineMonitor,
    EnginePool,
    EngineUnavailable,
    UpstreamError,
    map_stream_error,
)
from proxy.metrics import ProxyMetrics
from proxy.scheduler import Job, TrafficClass

logger = logging.getLogger(__name__)
T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected while the proxy was working on its request."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client hangs up first (then it is cancelled)."""
    box: list[T] = []
    failed: list[Exception] = []
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            box.append(await work)
        except Exception as exc:  # re-raised below, outside the task group
            failed.append(exc)
        group.cancel_scope.cancel()
    if failed:
        raise failed[0]
    if not box:
        raise ClientGone
    return box[0]


async def close_shielded(stack: AsyncExitStack) -> None:
    with anyio.CancelScope(shield=True):
        await stack.aclose()


@dataclass
class Opened:
    engine: str
    response: httpx.Response
    stack: AsyncExitStack


class Forwarder:
    def __init__(
        self,
        settings: Settings,
        admission: Admission,
        pool: EnginePool,
        monitor: EngineMonitor,
        metrics: ProxyMetrics,
        clock: Clock,
    ) -> None:
        self.settings = settings
        self.admission = admission
        self.pool = pool
        self.monitor = monitor
        self.metrics = metrics
        self.clock = clock
        self.estimator = TokenEstimator()

    async def handle(self, request: Request, path: str, default: TrafficClass) -> Response:
        arrival = self.clock.now()
        check_api_key(request, self.settings)
        body = await read_json(request)
        cls = traffic_class(request, default, self.settings)
        model = body["model"]
        if model not in self.admission.scheduler.models():
            raise model_not_found(model)
        if cls is TrafficClass.INTERACTIVE and not self._any_engine_up(model):
            # Interactive work does not wait for an engine to come back: 503 now.
            self.metrics.requests.labels(cls.value, "", "rejected").inc()
            raise engine_unavailable(f"No engine serving `{model}` is up.")
        tokens = await self._prompt_tokens(cls, model, body)
        job = Job(
            id=f"wt-{uuid.uuid4().hex}", cls=cls, model=model, prompt_tokens=tokens,
            arrival=arrival, affinity=affinity_key(body),
        )  # fmt: skip
        wish = stream_wish(body)
        learn = self._learner(job, prompt_text(body))
        try:
            if wish.stream:
                opened = await until_disconnect(request, self._open(job, path, body))
                return self._stream(job, opened, wish.include_usage, learn)
            return await until_disconnect(request, self._answer(job, path, body, learn))
        except PassThrough as exc:
            return exc.response()
        except ClientGone:
            if job.dispatched_at is None:
                self.metrics.requests.labels(cls.value, "", "cancelled").inc()
            logger.debug("client left before its answer started: %s", job.id)
            return Response(status_code=499)

    def _any_engine_up(self, model: str) -> bool:
        engines = self.admission.scheduler.engines.values()
        return any(e.up and e.serves(model) for e in engines)

    def _learner(self, job: Job, text: str) -> Callable[[int], None]:
        """Teach the estimator the engine's count for an estimated prompt."""
        if job.cls is TrafficClass.BATCH:
            return lambda _: None
        return lambda tokens: self.estimator.learn(job.model, text, tokens)

    async def _prompt_tokens(self, cls: TrafficClass, model: str, body: dict[str, Any]) -> int:
        """Exact (engine tokenizer) for batch; an estimate for interactive."""
        text = prompt_text(body)
        if cls is TrafficClass.BATCH:
            engine = next(
                (e for e in self.admission.scheduler.engines.values() if e.serves(model) and e.up),
                None,
            )
            if engine is not None:
                try:
                    client = self.pool.client_for(engine.name)
                    if isinstance(body.get("messages"), list):
                        return await client.count_tokens(model, messages=body["messages"])
                    return await client.count_tokens(model, prompt=body.get("prompt"))
                except (UpstreamError, ValueError) as exc:
                    # A malformed prompt is the engine's to reject; count it roughly.
                    logger.warning("tokenize failed on %s, estimating: %s", engine.name, exc)
        return self.estimator.estimate(model, text)

    async def _open(self, job: Job, path: str, body: dict[str, Any]) -> Opened:
        """Wait for the job's turn and open its upstream stream, retrying elsewhere
        while no byte has reached the client."""
        while True:
            engine = await self.admission.wait_for_engine(job)
            if job.attempts == 0 and job.dispatched_at is not None:
                self.metrics.queue_wait.labels(job.cls.value).observe(
                    job.dispatched_at - job.arrival
                )
            policy = self.pool.client_for(engine).config.scheduling_policy
            priority = job.cls.engine_priority if policy == "priority" else None
            upstream = upstream_body(body, priority)
            stack = AsyncExitStack()
            try:
                client = self.pool.client_for(engine)
                response = await stack.enter_async_context(client.stream(path, upstream))
                return Opened(engine, response, stack)
            except EngineUnavailable as exc:
                await close_shielded(stack)
                self.monitor.mark_failed(engine)
                if not self._retry(job, exc):
                    raise engine_unavailable(f"No engine could take the request: {exc}") from exc
            except EngineHTTPError as exc:
                await close_shielded(stack)
                headers = self._headers(job, engine)
                if exc.status < 500:
                    self._count(job, engine, "client_error")
                    self.admission.finished(job.id)
                    raise PassThrough(exc, headers) from exc
                if not self._retry(job, exc):
                    raise PassThrough(exc, headers) from exc
            except BaseException:
                await close_shielded(stack)
                self._count(job, engine, "cancelled")
                self.admission.abandon(job.id)
                raise

    def _retry(self, job: Job, exc: Exception) -> bool:
        engine = job.engine or ""  # before the requeue, which may dispatch it elsewhere
        requeued = self.admission.failed(job.id, retry=True)
        logger.warning("%s failed on %s (%s); retry elsewhere: %s", job.id, engine, exc, requeued)
        if not requeued:
            self.metrics.requests.labels(job.cls.value, engine, "engine_error").inc()
        return requeued

    def _count(self, job: Job, engine: str, outcome: str) -> None:
        self.metrics.requests.labels(job.cls.value, engine, outcome).inc()

    def _headers(self, job: Job, engine: str) -> dict[str, str]:
        queued = (job.dispatched_at or job.arrival) - job.arrival
        return {
            "X-Whoseturn-Class": job.cls.value,
            "X-Whoseturn-Engine": engine,
            "X-Whoseturn-Queue-Ms": f"{queued * 1000:.1f}",
        }

    def _relay(self, job: Job, opened: Opened, learn: Callable[[int], None]) -> Relay:
        return Relay(
            job, opened.engine, opened.response, self.admission, self.metrics, self.clock, learn
        )

    async def _answer(
        self, job: Job, path: str, body: dict[str, Any], learn: Callable[[int], None]
    ) -> Response:
        """A whole (non-streaming) answer; the stream may be retried if it breaks."""
        while True:
            opened = await self._open(job, path, body)
            relay = self._relay(job, opened, learn)
            assembler = Assembler(chat=path.endswith("/chat/completions"))
            try:
                async for event in relay.events():
                    if event.data is not None:
                        assembler.add(event.data)
            except httpx.HTTPError as exc:
                error = map_stream_error(opened.engine, exc)
                if self._retry(job, error):
                    continue
                raise engine_failed(f"The engine failed mid-answer: {error}") from exc
            except BaseException:
                relay.finish("cancelled")
                raise
            finally:
                await close_shielded(opened.stack)
            return self._finish_answer(job, relay, assembler, opened.engine)

    def _finish_answer(self, job: Job, relay: Relay, asm: Assembler, engine: str) -> Response:
        headers = self._headers(job, engine)
        error = relay.stats.engine_error
        if error is not None:
            relay.finish("engine_error")
            code = error.get("code")
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            return JSONResponse({"error": error}, status_code=status, headers=headers)
        relay.finish("ok")
        return JSONResponse(asm.body(), headers=headers)

    def _stream(
        self, job: Job, opened: Opened, include_usage: bool, learn: Callable[[int], None]
    ) -> Response:
        relay = self._relay(job, opened, learn)
        return RelayResponse(relay, opened.stack, include_usage, self._headers(job, opened.engine))


class PassThrough(Exception):
    """The engine's own error answer, to be given to the client unchanged."""

    def __init__(self, error: EngineHTTPError, headers: dict[str, str]) -> None:
        super().__init__(str(error))
        self.error = error
        self.headers = headers

    def response(self) -> Response:
        return Response(
            self.error.body,
            status_code=self.error.status,
            media_type=self.error.content_type or "application/json",
            headers=self.headers,
        )


class RelayResponse(StreamingResponse):
    """The engine's events relayed as they complete. When the response ends for any
    reason — finished, client gone, engine broken — the upstream is closed and the
    outcome recorded exactly once."""

    def __init__(
        self,
        relay: Relay,
        stack: AsyncExitStack,
        include_usage: bool,
        headers: dict[str, str],
    ) -> None:
        self._gen = self._bytes()
        super().__init__(self._gen, media_type="text/event-stream", headers=headers)
        self.relay = relay
        self.stack = stack
        self.include_usage = include_usage
        self.outcome = "cancelled"
        self._closed = False

    async def _bytes(self) -> AsyncIterator[bytes]:
        try:
            async for event in self.relay.events():
                if event.is_usage_only and not self.include_usage:
                    continue
                yield event.raw
            self.outcome = "engine_error" if self.relay.stats.engine_error else "ok"
        except httpx.HTTPError as exc:
            error = map_stream_error(self.relay.engine, exc)
            self.outcome = "engine_error"
            logger.warning("stream %s broke on %s: %s", self.relay.job.id, self.relay.engine, error)
            yield sse_error(f"The engine failed mid-stream: {error}")
            yield DONE
        finally:
            await self._close()

    async def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await close_shielded(self.stack)
        self.relay.finish(self.outcome)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._gen.aclose()  # type: ignore[attr-defined]
                await self._close()
