"""One upstream answer, relayed: the events seen, the timings taken, the outcome.

:class:`Relay` reads the engine's stream for one request. It tells the scheduler
(through :class:`~proxy.admission.Admission`) when the first token arrives and
each gap after it, records the request's metrics, and passes each event on: its
bytes unchanged to a streaming client (:mod:`proxy.api.stream`), or to an
:class:`~proxy.api.assemble.Assembler` (clients that asked for one body). When it
finishes, the engine's ``usage`` teaches the prompt counter, the job leaves the
scheduler with its output tokens (its tenant's fair share is charged by them), and
its tenant's limits and metrics count it (:class:`~proxy.api.metering.Metered`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import httpx

from proxy.admission import Admission, Admitted
from proxy.api.metering import Metered
from proxy.api.prompts import PromptCounter
from proxy.api.silence import Silence, fast_checkpoint
from proxy.api.sse import SSEEvent, SSEReader
from proxy.api.ticket import Ticket
from proxy.clock import Clock
from proxy.engines import AnswerWait, EngineStreamBroken, EngineTimeout, raw_chunks
from proxy.metrics import ProxyMetrics
from proxy.openai.answers import cached_tokens
from proxy.scheduler.limits import TenantMeter

Deliver = Callable[[list[SSEEvent]], Awaitable[None]]
"""Where :meth:`Relay.pump` passes the events, one read's (at most :data:`BATCH`) at a
time, in order: the client's stream, or an assembler."""
BATCH = 32
"""The most events passed on between two checkpoints (see :meth:`Relay.pump`)."""


@dataclass(frozen=True)
class ReadTimeouts:
    """How long an engine's stream may stay silent: before its first chunk
    (``first_byte_s``), then between chunks (``idle_s``)."""

    first_byte_s: float = 60.0
    idle_s: float = 30.0


@dataclass(frozen=True)
class Services:
    """What the request path reports to: the scheduler's door, the metrics, the
    clock, and the prompt counter; the read timeouts it keeps; and the tenants'
    limits (``meter``; None: none are kept)."""

    admission: Admission
    metrics: ProxyMetrics
    clock: Clock
    counter: PromptCounter
    timeouts: ReadTimeouts = ReadTimeouts()
    meter: TenantMeter | None = None


@dataclass
class RelayStats:
    last_token_at: float | None = None
    usage: dict[str, Any] | None = None
    engine_error: dict[str, Any] | None = None
    events: int = field(default=0)


class Relay:
    def __init__(
        self,
        ticket: Ticket,
        admitted: Admitted,
        response: httpx.Response,
        services: Services,
        chunks: AsyncIterator[bytes] | None = None,
        first: AnswerWait | None = None,
        metered: Metered | None = None,
    ) -> None:
        """``chunks``: the response's raw chunks where a first one was read already
        (an abortable job's, :mod:`proxy.api.abort_windows`); else ``response``'s own.
        ``first``: the watch on the engine's first chunk
        (:meth:`~proxy.engines.EngineMonitor.awaiting`), which the engine's ejection
        cuts short. ``metered``: the request counted against its tenant, told of its
        first token and its end."""
        self.ticket = ticket
        self.admitted = admitted
        self.engine = admitted.engine
        self.response = response
        self.services = services
        self.stats = RelayStats()
        self._chunks = chunks
        self._first = first
        self._metered = metered
        self._labels = (ticket.req.cls.value, admitted.engine)
        metrics = services.metrics
        # the labelled children, looked up once: the per-token path only observes
        self._ttft = metrics.ttft.labels(*self._labels)
        self._prefill = metrics.prefill.labels(*self._labels)
        self._inter_token = metrics.inter_token.labels(*self._labels)

    async def pump(self, deliver: Deliver) -> None:
        """Pass the engine's events to ``deliver`` as they complete; read errors
        propagate (httpx), and silence past the read's timeout (``first_byte_s``,
        then ``idle_s``) raises :class:`EngineTimeout`. One timer per stream keeps
        the timeout (:class:`~proxy.api.silence.Silence`), not one per read. The
        engine ejected before its first chunk raises :class:`EngineStreamBroken`
        then (the watch ``first``, where given).

        The events of one read are passed on together, so a streaming client gets
        them in one write: a proxy that falls behind its engines finds several events
        waiting per read and pays one send for them, not one each.

        A checkpoint follows every :data:`BATCH` events at the latest. One read can
        bring hundreds of events (a backlog, when the engine runs ahead of the proxy),
        and sending them to the client never suspends while its socket takes them or
        once it is gone: without the checkpoint the event loop would not run until the
        backlog was drained, so a client's hang-up (and every other request) would
        wait that long. A read of a few events needs none of its own: the next read
        waits for the engine (the loop runs then) unless the engine is ahead, and then
        the events add up to a checkpoint soon. (A checkpoint after every read cost a
        turn of the event loop per token: docs/overhead.md.)
        """
        timeouts = self.services.timeouts
        first = self._first
        with (
            Silence(min(timeouts.first_byte_s, timeouts.idle_s)) as silence,
            first if first is not None else nullcontext(),
        ):
            await self._pump(deliver, silence)
        if silence.expired:
            raise EngineTimeout(self.engine, f"the engine sent nothing for {silence.limit:g} s")
        if first is not None and first.cut:
            raise EngineStreamBroken(self.engine, f"{first.reason}, before its first chunk")

    async def _pump(self, deliver: Deliver, silence: Silence) -> None:
        reader = SSEReader()
        chunks = self._chunks if self._chunks is not None else raw_chunks(self.response)
        checkpoint = fast_checkpoint()
        observe = self._observe
        idle_s = self.services.timeouts.idle_s
        unchecked = 0  # events passed on since the last checkpoint
        began = None if self._first is None else self._first.began
        silence.reading(self.services.timeouts.first_byte_s)
        async for chunk in chunks:
            silence.read()
            if began is not None:  # the first chunk: the engine's ejection no longer cuts
                began()
                began = None
            events = reader.feed(chunk)
            for start in range(0, len(events), BATCH):
                batch = events if len(events) <= BATCH else events[start : start + BATCH]
                for event in batch:
                    observe(event)
                await deliver(batch)
                unchecked += len(batch)
                if unchecked >= BATCH:
                    await checkpoint()
                    unchecked = 0
            silence.reading(idle_s)
        silence.read()

    def _observe(self, event: SSEEvent) -> None:
        stats = self.stats
        stats.events += 1
        error = event.error
        if error is not None:
            stats.engine_error = error
        usage = event.usage
        if usage is not None:
            stats.usage = usage
        if event.has_token:
            self._token(self.services.clock.now())

    def _token(self, now: float) -> None:
        admission = self.services.admission
        last = self.stats.last_token_at
        self.stats.last_token_at = now
        if last is None:
            self._ttft.observe(now - self.ticket.arrival)
            self._prefill.observe(now - self.admitted.dispatched_at)
            admission.first_token(self.ticket.id)
            if self._metered is not None:
                self._metered.first_token(self.admitted.queued_s, now - self.ticket.arrival)
        else:
            self._inter_token.observe(now - last)
            admission.token_gap(self.ticket.id, now - last)

    def _cached(self, prompt: int, reported: int) -> None:
        """The engine said ``reported`` of the ``prompt`` tokens were in its prefix
        cache: the index learns from it, and the hit rate counts it."""
        found = self.services.admission.cached(self.ticket.id, reported)
        if found is None:
            return
        engine, expected = found
        metrics = self.services.metrics
        metrics.prefix_prompt.labels(engine).inc(prompt)
        metrics.prefix_cached.labels(engine, "expected").inc(expected)
        metrics.prefix_cached.labels(engine, "reported").inc(reported)

    def finish(self, outcome: str) -> None:
        """Record the outcome, learn from ``usage``, and release the job."""
        metrics, now = self.services.metrics, self.services.clock.now()
        usage = self.stats.usage or {}
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if isinstance(prompt, int):
            metrics.prompt_tokens.labels(*self._labels).inc(prompt)
            self.services.counter.learn(self.ticket.req, self.ticket.count, prompt)
        if isinstance(completion, int):
            metrics.completion_tokens.labels(*self._labels).inc(completion)
        cached = cached_tokens(usage)
        if cached is not None and isinstance(prompt, int):
            self._cached(prompt, cached)
        metrics.requests.labels(*self._labels, outcome).inc()
        metrics.request.labels(*self._labels).observe(now - self.ticket.arrival)
        output = completion if isinstance(completion, int) else None
        self.services.admission.finished(self.ticket.id, output)
        if self._metered is not None:
            said = isinstance(prompt, int) or output is not None
            tokens = (prompt if isinstance(prompt, int) else 0, output or 0) if said else None
            self._metered.end(now, tokens, self.admitted.queued_s)
