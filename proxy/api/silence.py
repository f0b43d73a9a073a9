"""The read timeout of one upstream stream, kept by one timer instead of a timer
per read.

A stream makes one read per event, and a cancel scope with a deadline per read
(``anyio.move_on_after``) costs a timer scheduled and cancelled, a scope entered
and left, and the backend looked up each time: at 256 streams it was ~10 % of the
proxy's CPU. :class:`Silence` instead notes when the pending read began (one clock
read) and keeps one timer on the event loop per stream, which wakes when that
read's limit would pass; only then, if the same read is still pending, does it
cancel the scope around the reads. The limit is per read, as before:
``first_byte_s`` for the first, ``idle_s`` after. (It was a watchdog task, in a
task group of its own: a task and a task group per request, which the timer
spares; docs/overhead.md.)

:func:`fast_checkpoint` is ``anyio.lowlevel.checkpoint`` with the event loop's kind
found once per stream, not once per event.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel


class Silence:
    """How long the pending read of one stream has waited. Used as ``with
    Silence(shortest_s) as silence:`` around the reads, on asyncio: the block is
    cancelled once a pending read passes its limit, and :attr:`expired` says so."""

    def __init__(self, shortest_s: float) -> None:
        """``shortest_s``: the shortest limit any read will have."""
        self.shortest_s = shortest_s
        self.expired = False
        self.limit = 0.0
        self._since: float | None = None  # when the pending read began; None: none pending
        self._scope = anyio.CancelScope()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> Silence:
        self._scope.__enter__()
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(self.shortest_s, self._check)
        return self

    def __exit__(self, *exc_info: object) -> bool:
        if self._timer is not None:
            self._timer.cancel()
        return bool(self._scope.__exit__(*exc_info))  # type: ignore[arg-type]

    def reading(self, limit: float) -> None:
        """A read begins, allowed ``limit`` seconds of silence."""
        self.limit = limit
        self._since = time.monotonic()

    def read(self) -> None:
        """The pending read returned."""
        self._since = None

    def _check(self) -> None:
        """The timer: cancel the block once the pending read is past its limit, else
        wake again when that read's limit would pass, but never later than the
        shortest limit from now: a read begun meanwhile (with a limit at least that)
        cannot pass its own before then."""
        since = self._since
        left = self.shortest_s if since is None else since + self.limit - time.monotonic()
        if left <= 0:
            self.expired = True
            self._scope.cancel()
            return
        assert self._loop is not None
        self._timer = self._loop.call_later(min(left, self.shortest_s), self._check)


Checkpoint = Callable[[], Awaitable[None]]


def fast_checkpoint() -> Checkpoint:
    """A checkpoint for the running event loop: on asyncio ``asyncio.sleep(0)``
    (which is what anyio's is there), else anyio's own. Call it once per stream:
    anyio's looks the backend up (sniffio, a context variable) on every call."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return anyio.lowlevel.checkpoint
    return functools.partial(asyncio.sleep, 0)
