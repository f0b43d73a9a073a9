"""The read timeout of one upstream stream, kept by one watchdog instead of a timer
per read.

A stream makes one read per event, and a cancel scope with a deadline per read
(``anyio.move_on_after``) costs a timer scheduled and cancelled, a scope entered
and left, and the backend looked up each time: at 256 streams it was ~10 % of the
proxy's CPU. :class:`Silence` instead notes when the pending read began (one clock
read) and runs one task per stream that sleeps until that read's limit would
pass; only then, if the same read is still pending, does it cancel the scope
around the reads. The limit is per read, as before: ``first_byte_s`` for the
first, ``idle_s`` after.

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
    """How long the pending read of one stream has waited; :meth:`watch` cancels
    ``scope`` once that passes the read's limit (and :attr:`expired` says so)."""

    def __init__(self, scope: anyio.CancelScope, shortest_s: float) -> None:
        """``shortest_s``: the shortest limit any read will have."""
        self.scope = scope
        self.shortest_s = shortest_s
        self.expired = False
        self.limit = 0.0
        self._since: float | None = None  # when the pending read began; None: none pending

    def reading(self, limit: float) -> None:
        """A read begins, allowed ``limit`` seconds of silence."""
        self.limit = limit
        self._since = time.monotonic()

    def read(self) -> None:
        """The pending read returned."""
        self._since = None

    async def watch(self) -> None:
        """Run until the stream ends: cancel ``scope`` once the pending read is past
        its limit. It sleeps until that read's limit would pass, but never longer
        than the shortest limit: a read begun during the sleep (with a limit at
        least that) cannot pass its own before it wakes."""
        while True:
            since = self._since
            left = self.shortest_s if since is None else since + self.limit - time.monotonic()
            if left <= 0:
                # no await since ``since`` was read: that read is the one still pending
                self.expired = True
                self.scope.cancel()
                return
            await anyio.sleep(min(left, self.shortest_s))


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
