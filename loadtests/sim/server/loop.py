"""The wall-clock driver of the simulated engine, and the token streams it feeds.

:class:`StepDriver.run` is the engine loop, one asyncio task per server: while the
engine has work it plans a step, sleeps until the step's end in wall time, applies
it and hands each token to the request's :class:`TokenStream`; when there is no
work it waits until a request arrives. The gauges are updated when a step is
planned (so ``running`` counts the batch in flight) and when it ends.

Model time does not drift while the engine is busy: each step is anchored at the
end of the one before, not at the moment the loop got round to it, so a late wake
is made up by sleeping less next time. A step that starts on an idle engine starts
now. How far the loop is behind its own schedule when a step ends is its *lag*
(model seconds, ``whoseturn_sim_lag_seconds``).
"""

from __future__ import annotations

import asyncio
import logging

from loadtests.sim.request import SimRequest
from loadtests.sim.server.metrics import SimMetrics
from loadtests.sim.step_loop import SimEngine, StepResult, TokenEvent
from proxy.clock import WallClock

logger = logging.getLogger(__name__)


class TokenStream:
    """The tokens of one engine request, in order, the last one ``finished``.

    Iterate it to receive tokens; :meth:`close` it when done. Closing a stream
    whose request has not finished aborts the request at once.
    """

    def __init__(self, driver: StepDriver, request: SimRequest) -> None:
        self.request = request
        self._driver = driver
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._done = False

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        event = await self._queue.get()
        self._done = event.finished
        return event

    def put(self, event: TokenEvent) -> None:
        self._queue.put_nowait(event)

    def close(self) -> None:
        """Abort the request unless its last token was received; idempotent."""
        if not self._done:
            self._done = True
            self._driver.abort(self.request.request_id)


class StepDriver:
    """Owns the engine's time; the only code that steps the engine."""

    def __init__(self, engine: SimEngine, clock: WallClock, metrics: SimMetrics) -> None:
        self.engine = engine
        self.clock = clock
        self.metrics = metrics
        self._streams: dict[str, TokenStream] = {}
        self._wake = asyncio.Event()

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def submit(
        self,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        request_id: str,
        priority: int = 0,
        seed: int | None = None,
    ) -> TokenStream:
        """Queue a request in the engine; raises ValueError as the engine does."""
        request = self.engine.add_request(
            prompt_token_ids, max_tokens, priority=priority, request_id=request_id, seed=seed
        )
        stream = TokenStream(self, request)
        self._streams[request.request_id] = stream
        self.metrics.update_gauges(self.engine)
        self._wake.set()
        logger.debug(
            "request %s: %d prompt tokens, max_tokens %d",
            request_id,
            len(prompt_token_ids),
            max_tokens,
        )
        return stream

    def abort(self, request_id: str) -> None:
        """Drop a request from the engine now (a no-op once it has finished)."""
        self._streams.pop(request_id, None)
        if self.engine.abort_request(request_id) is None:
            return
        self.metrics.on_abort(self.engine)
        self._wake.set()
        logger.debug("request %s aborted", request_id)

    def abort_all(self) -> int:
        """Abort every request still in flight; returns how many there were."""
        ids = list(self._streams)
        for request_id in ids:
            self.abort(request_id)
        return len(ids)

    async def run(self) -> None:
        """Step the engine forever (until cancelled)."""
        anchor: float | None = None
        while True:
            plan = self.engine.begin_step(start=anchor)
            if plan is None:
                anchor = None
                await self._idle()
                continue
            self.metrics.update_gauges(self.engine)
            end = plan.end
            await asyncio.sleep(max(0.0, self.clock.to_wall(end - self.clock.now())))
            result = self.engine.finish_step(plan)
            lag = max(0.0, self.clock.now() - end)
            self._deliver(result)
            self.metrics.on_step(result, self.engine, lag)
            anchor = end

    async def _idle(self) -> None:
        self.metrics.on_idle()
        self._wake.clear()
        await self._wake.wait()

    def _deliver(self, result: StepResult) -> None:
        for event in result.tokens:
            rid = event.request.request_id
            stream = self._streams.pop(rid) if event.finished else self._streams.get(rid)
            if stream is not None:
                stream.put(event)
