"""One upstream answer, relayed: the events seen, the timings taken, the outcome.

:class:`Relay` reads the engine's stream for one request. It tells the scheduler
(through :class:`~proxy.admission.Admission`) when the first token arrives and
each gap after it, records the request's metrics, and either yields the events'
bytes unchanged (streaming clients) or feeds them to an
:class:`~proxy.api.assemble.Assembler` (clients that asked for one body).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import httpx

from proxy.admission import Admission
from proxy.api.sse import SSEEvent, SSEReader
from proxy.clock import Clock
from proxy.metrics import ProxyMetrics
from proxy.scheduler import Job


@dataclass
class RelayStats:
    first_token_at: float | None = None
    last_token_at: float | None = None
    usage: dict[str, Any] | None = None
    engine_error: dict[str, Any] | None = None
    events: int = field(default=0)


class Relay:
    def __init__(
        self,
        job: Job,
        engine: str,
        response: httpx.Response,
        admission: Admission,
        metrics: ProxyMetrics,
        clock: Clock,
        learn: Callable[[int], None],
    ) -> None:
        self.job = job
        self.engine = engine
        self.response = response
        self.admission = admission
        self.metrics = metrics
        self.clock = clock
        self.learn = learn
        self.stats = RelayStats()
        self._labels = (job.cls.value, engine)

    async def events(self) -> AsyncIterator[SSEEvent]:
        """The engine's events as they complete; read errors propagate (httpx).

        Each event is followed by a checkpoint. One read can bring hundreds of events
        (a backlog, when the engine runs ahead of the proxy), and sending them to the
        client never suspends while its socket takes them or once it is gone: without
        the checkpoint the event loop would not run until the backlog was drained, so
        a client's hang-up (and every other request) would wait that long.
        """
        reader = SSEReader()
        async for chunk in self.response.aiter_raw():
            for event in reader.feed(chunk):
                self._observe(event)
                yield event
                await anyio.lowlevel.checkpoint()

    def _observe(self, event: SSEEvent) -> None:
        self.stats.events += 1
        if event.error is not None:
            self.stats.engine_error = event.error
        if event.data is not None and event.data.get("usage"):
            self.stats.usage = event.data["usage"]
        if not event.has_token:
            return
        now = self.clock.now()
        last = self.stats.last_token_at
        self.stats.last_token_at = now
        if last is None:
            self.stats.first_token_at = now
            self.metrics.ttft.labels(*self._labels).observe(now - self.job.arrival)
            if self.job.dispatched_at is not None:
                self.metrics.prefill.labels(*self._labels).observe(now - self.job.dispatched_at)
            self.admission.first_token(self.job.id)
        else:
            self.metrics.inter_token.labels(*self._labels).observe(now - last)
            self.admission.token_gap(self.job.id, now - last)

    def finish(self, outcome: str) -> None:
        """Record the outcome and release the job from the scheduler."""
        usage = self.stats.usage or {}
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if isinstance(prompt, int):
            self.metrics.prompt_tokens.labels(*self._labels).inc(prompt)
        if isinstance(completion, int):
            self.metrics.completion_tokens.labels(*self._labels).inc(completion)
        self.metrics.requests.labels(*self._labels, outcome).inc()
        self.metrics.request.labels(*self._labels).observe(self.clock.now() - self.job.arrival)
        if isinstance(prompt, int):
            self.learn(prompt)
        self.admission.finished(self.job.id, prompt if isinstance(prompt, int) else None)
