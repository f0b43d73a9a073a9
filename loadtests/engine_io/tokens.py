"""The arrival times of a stream's tokens, filled in as they come, and waited on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from loadtests.engine_io.info import EngineIOError
from loadtests.engine_io.sse import sse_events


class TokenLog:
    """Arrival times of one stream's tokens (tokens that come together share a time),
    and a way to wait for more."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.closed = False
        self.error: BaseException | None = None
        self._changed = asyncio.Event()

    def add(self, at: float, count: int | None = None) -> None:
        """Tokens arrived at ``at``: one more, or as many as make ``count`` in all."""
        target = len(self.times) + 1 if count is None else count
        while len(self.times) < target:
            self.times.append(at)
        self._changed.set()

    def close(self, error: BaseException | None = None) -> None:
        """The stream ended (with ``error`` if it failed); the first close counts."""
        if self.closed:
            return
        self.closed, self.error = True, error
        self._changed.set()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Until ``predicate()`` holds; raises :class:`EngineIOError` if the stream
        fails or ends before."""
        while not predicate():
            if self.error is not None:
                raise EngineIOError(f"the stream failed: {self.error!r}") from self.error
            if self.closed:
                raise EngineIOError(f"the stream ended after {len(self.times)} tokens")
            self._changed.clear()
            await self._changed.wait()

    async def wait_for(self, count: int) -> None:
        """Until the stream has ``count`` tokens; raises if it ends before."""
        await self.wait_until(lambda: len(self.times) >= count)


async def record_tokens(
    response: httpx.Response, log: TokenLog, clock: Callable[[], float]
) -> None:
    """Log the arrival of every token of a streamed completion until the stream ends
    (``[DONE]`` or the end of the body), then close the log (with the error, if reading
    failed). An event with choices is one token, or as many as its
    ``usage.completion_tokens`` says so far (vLLM's ``continuous_usage_stats``: a chunk
    may carry several).

    It reads on past the finishing chunk, to the end: a response read to its end gives
    its connection back to the client's pool, so the next request is not slowed by a
    new connection (calibration times requests from their sending)."""
    try:
        async for now, event in sse_events(response, clock):
            choices = event.get("choices")
            if not choices:
                continue
            usage = event.get("usage")
            count = usage.get("completion_tokens") if isinstance(usage, dict) else None
            log.add(now, count if isinstance(count, int) else None)
    except (httpx.HTTPError, ValueError) as exc:
        log.close(exc)
        return
    log.close()
