"""Forwarding one OpenAI request: read it, wait for its turn, stream it from an engine.

Every upstream call streams (the scheduler must see the first token). A client
that asked for a stream gets the engine's events relayed byte for byte as they
complete; one that asked for a body gets it assembled from them. Hang-ups abort
at once: while queued the job leaves the queue, while running the upstream
response is closed, which makes the engine abort the request.

Failures before the client has received a byte are retried on another engine
serving the model (a non-streaming answer counts as not yet received until it is
whole); a stream that breaks after bytes went out ends with an SSE error event.
Until the engine's answer begins (its response head, then its first chunk) the
wait is watched (:meth:`~proxy.engines.EngineMonitor.awaiting`): when the monitor
ejects the engine (a hung one fails its health checks), a request still waiting
there is taken off it at once and retried elsewhere like any other failure
before the client's first byte, not left to its ``first_byte_timeout_s``; a
streaming client whose response had begun (headers only) gets the SSE error.

A batch request the scheduler may abort in prefill for a chat (``batch_abort``,
:mod:`proxy.scheduler.aborts`) is sent with a window open
(:mod:`proxy.api.abort_windows`) until the engine's first chunk: nothing is relayed
to the client before then (a streaming client's response starts only then). Aborted inside it, the
upstream response is closed (vLLM aborts the request, its computed blocks stay
cached) and the same request waits for its next dispatch on the same engine; the
client sees only a later first token.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from proxy.admission import Admitted, Closed, NotWoken
from proxy.api.abort_windows import AbortWindows
from proxy.api.assemble import Assembler
from proxy.api.auth import caller
from proxy.api.disconnect import ClientGone, until_disconnect
from proxy.api.inputs import read_request
from proxy.api.metering import Metered, refuse_over_limit
from proxy.api.piece_sender import Final, PieceSender
from proxy.api.relay import Relay, Services
from proxy.api.request_ids import new_request_id, request_id, set_request_id
from proxy.api.servable import shutting_down, unservable
from proxy.api.sse import SSEEvent
from proxy.api.stream import RelayResponse, close_shielded
from proxy.api.ticket import Ticket
from proxy.cards import RETRY_S as WAKE_RETRY_S
from proxy.config import Settings
from proxy.engines import (
    AnswerWait,
    EngineConnectTimeout,
    EngineHTTPError,
    EngineMonitor,
    EnginePool,
    EngineTimeout,
    EngineUnavailable,
    UpstreamError,
    map_stream_error,
    raw_chunks,
)
from proxy.openai.answers import Answer
from proxy.openai.errors import APIError, engine_failed, engine_unavailable
from proxy.openai.request import ChatRequest
from proxy.scheduler import Abort, Job, TrafficClass

logger = logging.getLogger(__name__)
T = TypeVar("T")
ANSWERED_LATELY_S = 10.0
"""A connect timeout on an engine that answered within this long is the proxy's own
delay: the connection is tried once more, and the engine is not ejected."""


@dataclass
class Opened:
    """An upstream answer opened: ``chunks`` replaces the response's own raw chunks
    where the first was read already (an abortable job's)."""

    admitted: Admitted
    response: httpx.Response
    stack: AsyncExitStack
    chunks: AsyncIterator[bytes] | None = None

    @property
    def engine(self) -> str:
        return self.admitted.engine


Reserve = Callable[[str], Awaitable[bool]]
"""``await reserve(job_id)``: True to send the dispatched batch job, False if it was
queued again (:meth:`proxy.replicas.SharedBudget.reserve`)."""


@dataclass(eq=False)
class Forwarder:
    """The request path of the completion routes, from the client's request to the
    engine's answer. Its methods stand in the order a request meets them:

    1. :meth:`handle`: read and check the request (:meth:`_check_servable`), count its
       prompt, refuse it if its tenant is over a limit (429,
       :func:`~proxy.api.metering.refuse_over_limit`), give it its id
       (:meth:`_job_id`), and count it against its tenant to its end
       (:meth:`_metered`);
    2. :meth:`_open`: wait for its turn (:meth:`_wait` → :meth:`_queued` →
       :meth:`_admit`, the scheduler through the admission), reserve batch tokens in
       the shared budget (:meth:`_reserved`), send it to the engine
       (:meth:`_attempt` → :meth:`_connect` → :meth:`_first_chunk`), and on a failure
       before the client's first byte queue it again (:meth:`_open_failed`,
       :meth:`_retry`);
    3. relay: a stream as it comes (:meth:`_stream`), or a whole answer assembled
       (:meth:`_answer` → :meth:`_finish_answer`).

    Two other ways in: :meth:`complete` (a batch line, no client) and :meth:`abort`
    (the scheduler cuts a batch request in prefill for a chat)."""

    settings: Settings
    pool: EnginePool
    monitor: EngineMonitor
    services: Services
    piece_sender: PieceSender
    reserve: Reserve | None = None
    windows: AbortWindows = dataclasses.field(default_factory=AbortWindows, init=False)

    async def handle(self, request: Request, path: str, default: TrafficClass) -> Response:
        arrival = self.services.clock.now()
        req = await read_request(request, path, default, caller(request.scope))
        self._check_servable(req)
        count = await self.services.counter.count(req)
        services = self.services
        refuse_over_limit(services.meter, services.metrics, req, count.tokens)  # 429
        ticket = Ticket(self._job_id(request), req, arrival, count)
        metered = self._metered(ticket)
        streaming = False
        try:
            if req.wish.stream:
                opened = await until_disconnect(request.receive, self._open(ticket))
                response = self._stream(ticket, opened, metered)
                streaming = True  # its response ends it (the relay's finish)
                return response
            return await until_disconnect(request.receive, self._answer(ticket, metered))
        except PassThrough as exc:
            return exc.response()
        except ClientGone:
            logger.debug("client left before its answer started: %s", ticket.id)
            return Response(status_code=499)
        finally:
            if not streaming:  # ended already if its answer was relayed
                metered.end(self.services.clock.now())

    def _metered(self, ticket: Ticket) -> Metered:
        """The request counted against its tenant's limits from now to its end."""
        services = self.services
        return Metered(
            services.meter, services.metrics, ticket.req, ticket.arrival, ticket.count.tokens
        )

    def _check_servable(self, req: ChatRequest) -> None:
        error = unservable(req.model, req.cls, self.services.admission, self.monitor)
        if error is not None:
            if error.status == 503:
                self.services.metrics.requests.labels(req.cls.value, "", "rejected").inc()
            raise error

    def _job_id(self, request: Request) -> str:
        """The request's id (:mod:`proxy.api.request_ids`), which is its job's id in the
        scheduler and its decisions' in ``/turn/log``; a client's id already in use
        by a request in flight is replaced by a new one (the response says which)."""
        job_id = request_id(request.scope)
        if self.services.admission.knows(job_id):
            job_id = new_request_id()
            set_request_id(request.scope, job_id)
        return job_id

    async def _open(self, ticket: Ticket, retried: bool = False) -> Opened:
        """Wait for the job's turn and open its upstream stream, retrying elsewhere
        while no byte has reached the client, and again after an abort."""
        aborted = False
        while True:
            admitted = await self._wait(ticket, retried)
            retried = True
            if aborted:
                self.piece_sender.requeued(admitted.engine)
            if not await self._reserved(ticket):
                continue  # queued again: the shared budget refused it (batch only)
            try:
                opened = await self._attempt(ticket, admitted)
            except BaseException as exc:
                self._open_failed(ticket, admitted, exc)
                continue
            if opened is not None:
                return opened
            aborted = True  # requeued at the head of the batch queue: wait again

    async def _wait(self, ticket: Ticket, retried: bool) -> Admitted:
        """The job's next dispatch: queued first (after its pieces, where it goes in
        pieces), or requeued after a failure."""
        admission, req = self.services.admission, ticket.req
        try:
            if retried:
                admitted = await admission.readmit(ticket.id)
            else:
                admitted = await self._queued(ticket)
        except Closed:
            self._count(ticket, "", "rejected")  # queued when the drain began
            raise shutting_down() from None
        except NotWoken as exc:  # its model's wake on its card failed
            self._count(ticket, "", "rejected")
            raise engine_unavailable(str(exc), math.ceil(WAKE_RETRY_S)) from None
        except anyio.get_cancelled_exc_class():
            self._count(ticket, "", "cancelled")  # the client left while it waited
            raise
        self.services.metrics.queue_wait.labels(req.cls.value).observe(admitted.queued_s)
        if admitted.activation_s:  # it waited for its model to be woken on a card
            activation = self.services.metrics.cards.activation_wait
            activation.labels(req.cls.value, req.model).observe(admitted.activation_s)
        return admitted

    async def _queued(self, ticket: Ticket) -> Admitted:
        """The first dispatch of the client's own request. A long batch prompt that
        may be pieced starts in pieces where an engine pieces it now; one that
        starts whole is looked at again once the scheduler names its engine: chat
        that came there while it waited turns it into pieces (the turn is given
        back, and the pieces queue in its place)."""
        whole = Final(ticket.count.tokens, None, 0)
        sender = self.piece_sender
        up = await sender.pieceable(ticket)
        if up is None:
            return await self._admit(ticket, whole, whole_by_choice=False)
        if sender.wanted(ticket, up):
            return await self._admit(ticket, await sender.prefill(ticket, up), True)
        admitted = await self._admit(ticket, whole, whole_by_choice=True)
        if sender.keep_whole(ticket, admitted.engine):
            return admitted
        self.services.admission.finished(ticket.id)
        return await self._admit(ticket, await sender.prefill(ticket, [admitted.engine]), True)

    async def _admit(self, ticket: Ticket, final: Final, whole_by_choice: bool) -> Admitted:
        """Queue the client's own request as ``final`` says and wait for its turn."""
        req = ticket.req
        job = Job(
            id=ticket.id, cls=req.cls, model=req.model, prompt_tokens=final.tokens,
            arrival=ticket.arrival, affinity=req.affinity, pinned=final.engine,
            piece=final.piece, abortable=self._abortable(req.cls, final, whole_by_choice),
            blocks=ticket.count.blocks, prefix_tokens=ticket.count.tokens - final.tokens,
            tenant=req.tenant.name, flow=req.flow, weight=req.tenant.weight, tier=req.tier,
            expected_output=req.expected_output,
        )  # fmt: skip
        if job.abortable:
            cost = self.piece_sender.cost(final.engine)
            job.prefill_s = None if cost is None else cost * final.tokens
        return await self.services.admission.admit(job)

    def _abortable(self, cls: TrafficClass, final: Final, whole_by_choice: bool) -> bool:
        """Whether a job may be aborted in prefill for a chat (``batch_abort``):
        ``auto``, the final request of a pieced prompt (``final.engine`` set: its
        engine pieces) and a long prompt that could be pieced but goes whole
        (``whole_by_choice``): what it computed stays in the engine's prefix cache,
        and it is sent again on the same engine; ``on``,
        every batch request; ``off``, none."""
        mode = self.settings.sharing.batch_abort
        if cls is not TrafficClass.BATCH or mode == "off":
            return False
        return mode == "on" or final.engine is not None or whole_by_choice

    async def _reserved(self, ticket: Ticket) -> bool:
        """With several replicas, the job's tokens reserved in the shared budget
        (docs/replicas.md); False if it was queued again instead."""
        if self.reserve is None or ticket.req.cls is not TrafficClass.BATCH:
            return True
        try:
            return await self.reserve(ticket.id)
        except BaseException:
            self.services.admission.abandon(ticket.id)  # the client left meanwhile
            raise

    async def _attempt(self, ticket: Ticket, admitted: Admitted) -> Opened | None:
        """Open the job's upstream stream on its engine; an abortable job's within a
        window up to the engine's first chunk (read, and kept for the relay). None
        if it was aborted meanwhile: its upstream is closed, nothing was relayed."""
        admission = self.services.admission
        if not admission.abortable(ticket.id):
            return await self._connect(ticket, admitted)
        window = self.windows.open(ticket.id, admitted.engine)
        opened: Opened | None = None
        try:
            with window.scope:
                opened = await self._connect(ticket, admitted)
                opened = await self._first_chunk(opened)
        except BaseException as exc:
            if opened is not None:
                await close_shielded(opened.stack)
            if not window.aborted or isinstance(exc, anyio.get_cancelled_exc_class()):
                raise
            opened = None  # an error while being aborted: the abort stands
        finally:
            self.windows.close(ticket.id, window)
        if window.aborted:
            if opened is not None:
                await close_shielded(opened.stack)
            return None
        admission.answering(ticket.id)
        return opened

    async def _connect(self, ticket: Ticket, admitted: Admitted) -> Opened:
        """Open the job's upstream stream on its engine. A connect timeout on an
        engine that answered lately is tried once more: under a burst of new streams
        the proxy's own event loop can be too busy to see a connection made in time,
        and the request was not sent yet (the 503s once seen at 1,024 streams). The
        engine ejected while the response head is awaited cuts the wait short
        (:class:`EngineUnavailable`: retried elsewhere)."""
        client = self.pool.client_for(admitted.engine)
        body = ticket.req.body_for(client.config.scheduling_policy)
        timeout = self.settings.upstream.first_byte_timeout_s
        for attempt in range(2):
            stack = AsyncExitStack()
            try:
                with self.monitor.awaiting(admitted.engine) as wait:
                    opening = client.stream(ticket.req.path, body, first_byte_timeout_s=timeout)
                    response = await stack.enter_async_context(opening)
                if wait.cut:
                    reason = f"{wait.reason}, before its answer began"
                    raise EngineUnavailable(admitted.engine, reason)
            except EngineConnectTimeout as exc:
                await close_shielded(stack)
                if attempt or not self.monitor.answered_within(admitted.engine, ANSWERED_LATELY_S):
                    raise
                logger.info(
                    "%s: %s on %s, which answered lately: connecting again",
                    ticket.id,
                    exc,
                    admitted.engine,
                )
            except BaseException:
                await close_shielded(stack)
                raise
            else:
                self.monitor.answered(admitted.engine)
                return Opened(admitted, response, stack)
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _first_chunk(self, opened: Opened) -> Opened:
        """``opened`` with its first chunk read, to be relayed after it. A read that
        fails (or times out) is kept too, and raised where the relay reads it."""
        chunks = raw_chunks(opened.response)
        limit = self.services.timeouts.first_byte_s
        first: bytes | None = None
        error: Exception | None = None
        wait = self.monitor.awaiting(opened.engine)
        try:
            with wait, anyio.move_on_after(limit) as timer:
                first = await anext(chunks, None)
            if timer.cancelled_caught:
                error = EngineTimeout(opened.engine, f"the engine sent nothing for {limit:g} s")
        except (httpx.HTTPError, UpstreamError) as exc:
            error = exc
        if wait.cut:  # nothing was relayed yet: retried elsewhere
            raise EngineUnavailable(opened.engine, f"{wait.reason}, before its first chunk")
        return dataclasses.replace(opened, chunks=_replay(first, error, chunks))

    def _open_failed(self, ticket: Ticket, admitted: Admitted, exc: BaseException) -> None:
        """Returns if the job was queued again for another engine; else raises what
        the client is to see."""
        engine = admitted.engine
        if isinstance(exc, EngineUnavailable):
            slow = isinstance(exc, EngineConnectTimeout)
            if not (slow and self.monitor.answered_within(engine, ANSWERED_LATELY_S)):
                self.monitor.mark_failed(engine, f"a request could not reach it ({exc})")
            if self._retry(ticket, engine, exc):
                return
            retry = max(1, math.ceil(self.monitor.settings.upstream.health_interval_s))
            raise engine_unavailable(f"No engine could take the request: {exc}", retry) from exc
        if isinstance(exc, EngineHTTPError):
            headers = self._headers(ticket, admitted)
            if exc.status < 500:
                self._count(ticket, engine, "client_error")
                self.services.admission.finished(ticket.id)
                raise PassThrough(exc, headers) from exc
            self.monitor.request_failed(engine, exc)
            if self._retry(ticket, engine, exc):
                return
            raise PassThrough(exc, headers) from exc
        self._count(ticket, engine, "cancelled")
        self.services.admission.abandon(ticket.id)
        raise exc

    def _retry(self, ticket: Ticket, engine: str, exc: Exception) -> bool:
        requeued = self.services.admission.failed(ticket.id, retry=True)
        logger.warning(
            "%s failed on %s (%s); retry elsewhere: %s", ticket.id, engine, exc, requeued
        )
        if not requeued:
            self._count(ticket, engine, "engine_error")
        return requeued

    def _stream(self, ticket: Ticket, opened: Opened, metered: Metered) -> Response:
        relay = Relay(
            ticket, opened.admitted, opened.response, self.services, opened.chunks,
            self._first_chunk_wait(opened), metered,
        )  # fmt: skip
        headers = self._headers(ticket, opened.admitted)
        wish = ticket.req.wish
        return RelayResponse(relay, opened.stack, wish.include_usage, headers, self.monitor)

    def _first_chunk_wait(self, opened: Opened) -> AnswerWait | None:
        """The watch on the engine's first chunk for the relay, where it is still to
        come (an abortable job's was read already)."""
        return self.monitor.awaiting(opened.engine) if opened.chunks is None else None

    async def _answer(self, ticket: Ticket, metered: Metered) -> Response:
        """A whole (non-streaming) answer; the stream may be retried if it breaks."""
        retried = False
        while True:
            opened = await self._open(ticket, retried)
            relay = Relay(
                ticket, opened.admitted, opened.response, self.services, opened.chunks,
                self._first_chunk_wait(opened), metered,
            )  # fmt: skip
            assembler = Assembler(chat=ticket.req.chat)

            async def add(events: list[SSEEvent], assembler: Assembler = assembler) -> None:
                for event in events:
                    if event.data is not None:
                        assembler.add(event.data)

            try:
                await relay.pump(add)
            except (httpx.HTTPError, UpstreamError) as exc:
                error = map_stream_error(opened.engine, exc)
                self.monitor.request_failed(opened.engine, error)
                if retried := self._retry(ticket, opened.engine, error):
                    continue
                raise engine_failed(f"The engine failed mid-answer: {error}") from exc
            except BaseException:
                relay.finish("cancelled")
                raise
            finally:
                await close_shielded(opened.stack)
            return self._finish_answer(ticket, relay, assembler)

    def _finish_answer(self, ticket: Ticket, relay: Relay, asm: Assembler) -> Response:
        headers = self._headers(ticket, relay.admitted)
        error = relay.stats.engine_error
        if error is not None:
            relay.finish("engine_error")
            code = error.get("code")
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            return _Assembled({"error": error}, status_code=status, headers=headers)
        relay.finish("ok")
        self.monitor.request_succeeded(relay.engine)
        return _Assembled(asm.body(), headers=headers)

    @staticmethod
    def _headers(ticket: Ticket, admitted: Admitted) -> dict[str, str]:
        headers = {
            "X-Whoseturn-Class": ticket.req.cls.value,
            "X-Whoseturn-Engine": admitted.engine,
            "X-Whoseturn-Queue-Ms": f"{admitted.queued_s * 1000:.1f}",
        }
        if admitted.activation_s:  # of the queue wait, the wait for its model's wake
            headers["X-Whoseturn-Activation-Ms"] = f"{admitted.activation_s * 1000:.1f}"
        return headers

    def _count(self, ticket: Ticket, engine: str, outcome: str) -> None:
        self.services.metrics.requests.labels(ticket.req.cls.value, engine, outcome).inc()

    async def complete(self, req: ChatRequest, job_id: str) -> Answer:
        """One whole answer for work with no client connection (a batch job's line),
        through the same admission, engines and relay as a request: the status and
        JSON body a client would have had, its bytes as made for the response (not
        parsed again). Cancelling the caller aborts the work."""
        arrival = self.services.clock.now()
        metered: Metered | None = None
        try:
            self._check_servable(req)
            count = await self.services.counter.count(req)
            ticket = Ticket(job_id, req, arrival, count)
            metered = self._metered(ticket)  # counted, not refused: the runner holds lines
            response = await self._answer(ticket, metered)
        except PassThrough as exc:
            return Answer.of(exc.error.status, _json_or_error(exc.error.body))
        except APIError as exc:
            return Answer.of(exc.status, exc.body())
        finally:
            if metered is not None:
                metered.end(self.services.clock.now())
        assert isinstance(response, _Assembled)
        return Answer(response.status_code, bytes(response.body), response.content)

    def abort(self, abort: Abort) -> bool:
        """Cut batch job ``abort.job_id``'s upstream request if nothing of it can have
        reached its client yet; whether it was (the admission then requeues it)."""
        if not self.windows.abort(abort.job_id, abort.engine):
            return False
        logger.info(
            "%s: aborted in prefill on %s, to be requeued: chat %s waited %.3f s and "
            "%.3f s of its prefill was left, past the TTFT aim %.3f s (abort %d of %d)",
            abort.job_id, abort.engine, abort.chat_id, abort.waited_s, abort.remaining_s,
            abort.aim_s, abort.number, abort.limit,
        )  # fmt: skip
        self.piece_sender.aborted(abort.engine)
        return True


async def _replay(
    first: bytes | None, error: Exception | None, rest: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """The chunks of a response whose first was read already: ``error`` if that
    read failed; else ``first`` (None: there was none), then ``rest``."""
    if error is not None:
        raise error
    if first is None:
        return
    yield first
    async for chunk in rest:
        yield chunk


class _Assembled(JSONResponse):
    """A whole answer's response that keeps the object its body was made from."""

    def __init__(self, content: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.content = content


def _json_or_error(raw: bytes) -> dict[str, Any]:
    """An engine's error answer as an object for a batch line: its JSON, or an
    OpenAI-shaped error carrying its text when it is not a JSON object."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict):
        return body
    message = raw.decode(errors="replace")[:500]
    return {"error": {"message": message, "type": "engine_error", "param": None, "code": None}}


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
