"""Request bodies in flight: the bytes of every request body the proxy holds at once,
counted against one budget (``max_body_bytes_in_flight``).

``max_body_bytes`` bounds one body; this bounds them all together, so that many large
bodies at once cannot take the process's memory. :mod:`~proxy.api.body_limits`
reserves a body's bytes when its ``Content-Length`` arrives (or as its chunks arrive,
without one) and gives them back when the request ends; a body the budget cannot take
is refused with 503 and ``Retry-After`` (the budget frees as requests finish).

A body of at most :data:`SMALL_BODY_BYTES` is counted but never refused: chat requests
are small, and a few clients holding the budget with large bodies (or declaring large
bodies and sending them slowly, until ``body_timeout_s``) must not turn every chat
away. So the bodies held are bounded by the budget plus that much per request in
flight.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

SMALL_BODY_BYTES = 64 * 1024
"""Bodies up to this size are counted but never refused (uvicorn's read buffer)."""


class BodyBudget:
    """The bytes reserved by the bodies in flight, against ``limit``. One per app."""

    def __init__(self, limit: int, small: int = SMALL_BODY_BYTES) -> None:
        self.limit = limit
        self.small = small
        self.held = 0
        self.refused = 0

    def take(self, extra: int, body_total: int) -> bool:
        """Reserve ``extra`` more bytes for a body that then holds ``body_total``;
        False (nothing reserved) if that passes the limit and the body is not small."""
        if body_total > self.small and self.held + extra > self.limit:
            self.refused += 1
            return False
        self.held += extra
        return True

    def give(self, nbytes: int) -> None:
        self.held -= nbytes

    def ticket(self) -> BodyTicket:
        """An empty reservation for one request's body."""
        return BodyTicket(self)


class BodyTicket:
    """One request's reservation: :meth:`cover` grows it as the body does,
    :meth:`release` gives it all back."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.reserved = 0

    def cover(self, body_total: int) -> bool:
        """Reserve up to ``body_total`` bytes for this body; False if the budget refuses."""
        extra = body_total - self.reserved
        if extra <= 0:
            return True
        if not self.budget.take(extra, body_total):
            return False
        self.reserved = body_total
        return True

    def release(self) -> None:
        self.budget.give(self.reserved)
        self.reserved = 0


LARGE_BODY_BYTES = 1024 * 1024
"""A body at least this large, once its request ends, has its memory given back
(:class:`MemoryReturn`)."""


SOON_S = 0.05
"""How long :class:`MemoryReturn` lets the request that ended finish its task."""


class MemoryReturn:
    """Gives the memory of large bodies back to the system once their requests end.

    Two things keep it otherwise, measured with 64 bodies of 8 MB (docs/security.md):

    - reference cycles: every upstream ``httpx.Response`` is in one (its stream holds
      it), and it holds its request, whose content is the body sent to the engine.
      With the proxy's garbage collector thresholds
      (:data:`proxy.process.uvicorn_server.GC_THRESHOLDS`) large requests allocate too
      few objects to start a collection, so an idle proxy
      kept 600 MB of dead bodies; and a young collection moves the cycles of requests
      still running into the old generation, where they outlive their requests;
    - glibc's heap: freed chunks in its middle are not returned (only its top is
      trimmed), so after a collection it still held twice its baseline.

    So once large bodies stop ending for ``settle_s``, or as soon as
    ``collect_after_bytes`` of them have ended since the last time: one full
    collection, then glibc's ``malloc_trim(0)`` (``trim``; only on glibc). One
    collection per burst of large bodies, or per ``collect_after_bytes`` of them: one
    took 80-190 ms (the event loop waits), reading and forwarding that many bytes more.
    """

    def __init__(
        self,
        *,
        collect_after_bytes: int,
        settle_s: float = 1.0,
        trim: Callable[[], object] | None = None,
    ) -> None:
        self.collect_after_bytes = collect_after_bytes
        self.settle_s = settle_s
        self.trim = trim
        self.freed = 0
        self.runs = 0
        self._scheduled: asyncio.TimerHandle | None = None

    def body_freed(self, nbytes: int) -> None:
        """A request whose body held ``nbytes`` has ended."""
        if nbytes < LARGE_BODY_BYTES:
            return
        self.freed += nbytes
        if self._scheduled is not None:
            self._scheduled.cancel()
        delay = SOON_S if self.freed >= self.collect_after_bytes else self.settle_s
        self._scheduled = asyncio.get_running_loop().call_later(delay, self.give_back)

    def give_back(self) -> None:
        """Collect the garbage and trim the heap now."""
        self._scheduled = None
        freed, self.freed = self.freed, 0
        started = time.perf_counter()
        collected = gc.collect()
        collected_at = time.perf_counter()
        if self.trim is not None:
            self.trim()
        self.runs += 1
        logger.debug(
            "%d bytes of large bodies freed: %d objects collected in %.1f ms, the heap "
            "trimmed in %.1f ms",
            freed,
            collected,
            (collected_at - started) * 1000,
            (time.perf_counter() - collected_at) * 1000,
        )


def glibc_malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library is not glibc."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (ValueError, OSError, AttributeError):
        return None
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    return lambda: malloc_trim(0)
