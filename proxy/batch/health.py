"""The batch store's health: an outage noticed once, answered fast, waited out.

:class:`GuardedStore` stands in front of a backend (:class:`~proxy.batch.store.BatchStore`)
and is what the routes and the runner use:

- a quick call (a row read or written) runs under a deadline, ``timeout_s``
  (None: none; SQLite's calls run on a worker thread and cannot be cut short);
  the long ones (a file copied, a job's lines stored, its files written) have
  none of their own;
- an error the backend names an outage (its ``outage_errors``: a connection lost,
  no connection to be had, the server shut down) or a deadline passed marks the
  store down: logged once, with its cause, and every call still waiting on it is
  abandoned at once;
- while it is down every call fails at once with :class:`StoreDown` (the routes
  answer 503 with ``Retry-After``, the runner waits and tries again), so nothing
  waits on a database that does not answer;
- :meth:`GuardedStore.watch` pings the store every ``probe_s`` while it is up (a
  paused database is found within ``probe_s`` plus the ping's deadline even when
  no request comes), and while it is down with a backoff from ``probe_s`` up to
  :data:`MAX_BACKOFF_S`; the first ping answered marks it up again, logged with
  how long the outage lasted.

:class:`StoreHealth` is the state (:class:`~proxy.availability.Availability` and the
probes' backoff), pure, on an injected clock.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import KW_ONLY, InitVar, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio

from proxy.availability import Availability
from proxy.batch.store import (
    BatchRecord,
    BatchStore,
    FileRecord,
    Json,
    LineResult,
    LineSpec,
    NewBatch,
    PendingLine,
    Progress,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")
MAX_BACKOFF_S = 5.0
PING_TIMEOUT_S = 0.4


class StoreDown(Exception):
    """The batch store is unavailable; ``retry_after_s``: when to ask again."""

    def __init__(self, cause: str, retry_after_s: float) -> None:
        super().__init__(f"the batch store is unavailable: {cause}")
        self.cause = cause
        self.retry_after_s = retry_after_s


@dataclass
class StoreHealth(Availability):
    """The store's :class:`~proxy.availability.Availability`, and its probes while down."""

    probe_s: float = 0.2
    failed_probes: int = 0  # in this outage

    def back(self, now: float) -> float | None:
        self.failed_probes = 0
        return super().back(now)

    def backoff_s(self) -> float:
        """How long to wait before the next probe (or try) while down."""
        return min(self.probe_s * 2.0**self.failed_probes, MAX_BACKOFF_S)

    def error(self) -> StoreDown:
        return StoreDown(self.cause, self.backoff_s())

    def view(self, now: float) -> Json:
        """For ``/readyz`` and ``/turn``: up, for how long (or down since), why."""
        return {
            "up": self.up,
            "for_s": round(max(0.0, now - self.since), 3),
            "cause": self.cause or None,
            "outages": self.outages,
        }


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text and text[0] else type(exc).__name__


@dataclass(eq=False)
class GuardedStore:
    """A :class:`~proxy.batch.store.BatchStore` that fails fast while its backend is
    down (see the module docstring). ``now`` is the clock the health is kept on."""

    inner: BatchStore
    now: Callable[[], float]
    _: KW_ONLY
    timeout_s: float | None
    outage_errors: tuple[type[BaseException], ...]
    probe_s: InitVar[float] = 0.2
    open_timeout_s: float | None = None
    opened: bool = field(default=False, init=False)
    health: StoreHealth = field(init=False)
    _waiting: set[anyio.CancelScope] = field(default_factory=set, init=False)

    def __post_init__(self, probe_s: float) -> None:
        self.health = StoreHealth(probe_s=probe_s, since=self.now())

    # -- the state ----------------------------------------------------------------

    def _down(self, cause: str) -> None:
        if not self.health.down(self.now(), cause):
            return
        logger.error(
            "batch store down: %s; Files/Batches answer 503 and batch jobs wait until it "
            "answers again", cause,
        )  # fmt: skip
        for scope in list(self._waiting):
            scope.cancel()

    def _back(self) -> None:
        lasted = self.health.back(self.now())
        if lasted is not None:
            logger.warning("batch store back after %.1f s; batch jobs resume", lasted)

    def check(self) -> None:
        """Raise :class:`StoreDown` at once if the store is known to be down."""
        if not self.health.up:
            raise self.health.error()

    async def _within(
        self, call: Callable[[], Awaitable[T]], timeout_s: float | None, late: str, waits: bool
    ) -> T:
        """``call()`` within ``timeout_s`` (None: no limit): an outage error, or no answer
        by then (the cause: ``late`` within the limit), puts the store down and raises
        :class:`StoreDown`. A call that ``waits`` on the store is abandoned as soon as
        the store is found down (a probe or an opening runs on)."""
        deadline = math.inf if timeout_s is None else anyio.current_time() + timeout_s
        scope = anyio.CancelScope(deadline=deadline)
        if waits:
            self._waiting.add(scope)
        try:
            with scope:
                return await call()
        except self.outage_errors as exc:
            self._down(_describe(exc))
            raise self.health.error() from exc
        finally:
            self._waiting.discard(scope)
        # reached only when the scope was cancelled: the deadline, or an outage
        if self.health.up:
            self._down(f"{late} within {timeout_s:g} s")
        raise self.health.error()

    async def _quick(self, call: Callable[[], Awaitable[T]]) -> T:
        self.check()
        return await self._within(call, self.timeout_s, "no answer", waits=True)

    async def _long(self, call: Callable[[], Awaitable[T]]) -> T:
        self.check()
        return await self._within(call, None, "", waits=True)

    async def ping(self) -> None:
        """One probe: the backend's cheapest round trip, under a short deadline (its
        opening, if it has not opened yet)."""
        if not self.opened:
            await self._open_within(self.open_timeout_s or PING_TIMEOUT_S)
            return
        deadline = PING_TIMEOUT_S if self.timeout_s is None else min(PING_TIMEOUT_S, self.timeout_s)
        await self._within(self.inner.ping, deadline, "no answer to a ping", waits=False)
        self._back()

    async def watch(self) -> None:
        """Forever: ping every ``probe_s`` while up, with backoff while down."""
        while True:
            await anyio.sleep(self.health.probe_s if self.health.up else self.health.backoff_s())
            try:
                await self.ping()
            except StoreDown:
                self.health.failed_probes += 1

    # -- the store's methods ------------------------------------------------------

    async def open(self) -> None:
        """Open the backend. With ``open_timeout_s`` set (PostgreSQL), a store that
        does not answer within it, or fails as in an outage, leaves the proxy
        starting all the same with the store down: :meth:`watch` opens it when it
        answers. Without (SQLite), any failure stops the start."""
        if self.open_timeout_s is None:
            await self.inner.open()
            self.opened = True
            return
        try:
            await self._open_within(self.open_timeout_s)
        except StoreDown:
            logger.error("batch store not reachable at start; the proxy starts without it")

    async def _open_within(self, timeout_s: float) -> None:
        await self._within(self.inner.open, timeout_s, "not open", waits=False)
        self.opened = True
        self._back()

    async def close(self) -> None:
        await self.inner.close()

    def spool_path(self) -> Path:
        self.check()
        return self.inner.spool_path()

    async def add_file(self, purpose: str, filename: str, source: Path) -> FileRecord:
        return await self._long(lambda: self.inner.add_file(purpose, filename, source))

    async def get_file(self, file_id: str) -> FileRecord | None:
        return await self._quick(lambda: self.inner.get_file(file_id))

    async def list_files(self, after: str | None, limit: int) -> list[FileRecord]:
        return await self._quick(lambda: self.inner.list_files(after, limit))

    async def delete_file(self, file_id: str) -> bool:
        return await self._quick(lambda: self.inner.delete_file(file_id))

    async def read_file(self, file_id: str) -> AsyncIterator[bytes]:
        self.check()
        chunks = aiter(self.inner.read_file(file_id))
        while True:
            try:
                chunk = await self._quick(lambda: anext(chunks))
            except StopAsyncIteration:
                return
            yield chunk

    @asynccontextmanager
    async def local_file(self, file_id: str) -> AsyncIterator[Path]:
        opened: list[AbstractAsyncContextManager[Path]] = []

        async def enter() -> Path:
            opened.append(self.inner.local_file(file_id))
            return await opened[0].__aenter__()

        path = await self._long(enter)
        held = opened[0]
        try:
            yield path
        except BaseException as exc:
            if not await held.__aexit__(type(exc), exc, exc.__traceback__):
                raise
        else:
            await held.__aexit__(None, None, None)

    async def add_batch(self, new: NewBatch) -> BatchRecord:
        return await self._quick(lambda: self.inner.add_batch(new))

    async def fill_batch(self, batch_id: str, lines: Iterator[LineSpec]) -> BatchRecord:
        return await self._long(lambda: self.inner.fill_batch(batch_id, lines))

    async def fail_batch(self, batch_id: str, errors: list[Json]) -> BatchRecord:
        return await self._quick(lambda: self.inner.fail_batch(batch_id, errors))

    async def expire_pending(self, batch_id: str, line_for: Callable[[str], LineResult]) -> int:
        return await self._long(lambda: self.inner.expire_pending(batch_id, line_for))

    async def get_batch(self, batch_id: str) -> BatchRecord | None:
        return await self._quick(lambda: self.inner.get_batch(batch_id))

    async def list_batches(self, after: str | None, limit: int) -> list[BatchRecord]:
        return await self._quick(lambda: self.inner.list_batches(after, limit))

    async def active_batches(self) -> list[BatchRecord]:
        return await self._quick(self.inner.active_batches)

    async def set_status(self, batch_id: str, status: str, only_from: tuple[str, ...]) -> bool:
        return await self._quick(lambda: self.inner.set_status(batch_id, status, only_from))

    async def claim(
        self, batch_id: str, owner: str, limit: int, lease_s: float
    ) -> list[PendingLine]:
        return await self._quick(lambda: self.inner.claim(batch_id, owner, limit, lease_s))

    async def renew(self, batch_id: str, owner: str, lines: Sequence[int], lease_s: float) -> int:
        return await self._quick(lambda: self.inner.renew(batch_id, owner, lines, lease_s))

    async def release(self, batch_id: str, owner: str) -> int:
        return await self._quick(lambda: self.inner.release(batch_id, owner))

    async def record(self, batch_id: str, idx: int, result: LineResult) -> bool:
        return await self._quick(lambda: self.inner.record(batch_id, idx, result))

    async def add_progress(self, batch_id: str, progress: Progress) -> None:
        await self._quick(lambda: self.inner.add_progress(batch_id, progress))

    async def finalize(self, batch_id: str, status: str) -> BatchRecord:
        return await self._long(lambda: self.inner.finalize(batch_id, status))

    async def count_by_status(self) -> dict[str, int]:
        return await self._quick(self.inner.count_by_status)

    def __getattr__(self, name: str) -> Any:
        """A backend's own extras (SQLite's ``file_path``, PostgreSQL's
        ``schema_version``), for tests and tools."""
        return getattr(self.inner, name)
