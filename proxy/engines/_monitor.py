"""Health checks and ``/metrics`` scrapes of every engine, fed to the scheduler.

- An engine whose health check fails (no 2xx within ``settings.upstream.health_timeout_s``)
  ``settings.upstream.unhealthy_after`` times in a row is ejected
  (``scheduler.set_engine_up(name, False)``); one passing check readmits it.
- :meth:`EngineMonitor.mark_failed` ejects at once, for the request path that saw
  the engine refuse a connection. Health answers to checks sent before that call
  are ignored, so a check already in flight cannot readmit the engine.
- Outlier detection on the request path, after Envoy's: a stream that timed out
  (:class:`~proxy.engines.EngineTimeout`, a hung engine) ejects its engine at
  once; other failures (a broken stream, a 5xx) eject it after
  ``settings.upstream.outlier_consecutive_errors`` in a row with no success between
  (:meth:`EngineMonitor.request_failed`, :meth:`EngineMonitor.request_succeeded`).
  Recovery is by health check, as above.
- :meth:`EngineMonitor.answered_within` says whether an engine answered lately (a
  passing health check, or a request whose response began): a connect timeout on
  such an engine is taken for the proxy's own delay (a burst of new streams on a
  busy event loop), not a reason to eject it (:mod:`proxy.api.forward`).
- Requests waiting for an engine's answer to begin (:meth:`EngineMonitor.awaiting`)
  are cut off when that engine is ejected, for whatever reason: the request path
  then sends them to another engine, or fails them. A request sent to an engine
  that has just hung therefore waits until the ejection, not its
  ``first_byte_timeout_s``: with health checks alone, at most
  ``unhealthy_after * (health_interval_s + health_timeout_s)`` after the engine
  stopped (12 s by default; docs/security.md).
- The loads of up engines go to ``scheduler.observe_load``. A failed scrape is
  logged at warning and counted in ``scrape_failures``; the scheduler keeps the
  last load it was given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Protocol

import anyio

from proxy.config import Settings
from proxy.engines._client import EngineClient
from proxy.engines._exceptions import EngineTimeout, UpstreamError
from proxy.engines._pool import EnginePool
from proxy.scheduler import EngineLoad

logger = logging.getLogger(__name__)


class EngineStateSink(Protocol):
    """What the monitor tells the scheduler (:class:`proxy.scheduler.Scheduler`)."""

    def set_engine_up(self, name: str, up: bool) -> None: ...

    def observe_load(self, name: str, load: EngineLoad) -> None: ...


class AnswerWait:
    """One request waiting for engine ``engine``'s answer to begin, used as ``with``
    around that wait (from :meth:`EngineMonitor.awaiting`). Ejecting the engine
    while the block runs cancels it, and so does entering it while the engine is
    out; :attr:`cut` then says so and :attr:`reason` why. :meth:`began` ends the
    watch inside the block (the answer began: ejecting the engine no longer cuts it)."""

    def __init__(self, engine: str, monitor: EngineMonitor) -> None:
        self.engine = engine
        self.reason = ""
        self._monitor = monitor
        self._scope = anyio.CancelScope()
        self._watched = False

    def __enter__(self) -> AnswerWait:
        self._scope.__enter__()
        self._watched = self._monitor._watch(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self.began()
        return self._scope.__exit__(exc_type, exc, tb)

    @property
    def cut(self) -> bool:
        """Whether the engine's ejection ended the block."""
        return self._scope.cancelled_caught

    def began(self) -> None:
        """The answer began: the engine's ejection no longer cuts this wait."""
        if self._watched:
            self._watched = False
            self._monitor._unwatch(self)

    def eject(self, reason: str) -> None:
        """The engine is out (``reason``): cut the wait."""
        self.reason = reason
        self._scope.cancel()


class EngineMonitor:
    """Keeps ``up`` (by engine name) and the scheduler's view of each engine current.

    Every engine starts up, as in the scheduler. ``on_change(name, up)`` is called
    after each ejection and readmission. ``health_rounds`` counts finished rounds of
    health checks (``readyz`` can wait for the first one).
    """

    def __init__(
        self,
        pool: EnginePool,
        scheduler: EngineStateSink,
        settings: Settings,
        on_change: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.settings = settings
        self.on_change = on_change
        self.up: dict[str, bool] = {}
        self.failures: dict[str, int] = {}
        self.scrape_failures: dict[str, int] = {}
        self.request_errors: dict[str, int] = {}
        self.ejected_because: dict[str, str] = {}
        self.answered_at: dict[str, float] = {}  # time.monotonic() of its last answer
        self.health_rounds = 0
        self._epoch: dict[str, int] = {}
        self._waits: dict[str, set[AnswerWait]] = {}  # requests waiting for an answer
        self.resting: set[str] = set()  # asleep or stopped on a card: not checked
        for name in pool.engines:
            self.add(name)

    def add(self, name: str) -> None:
        """Watch engine ``name`` too (it joined; it starts up, as in the scheduler)."""
        if name in self.up:
            return
        self.up[name] = True
        self.failures[name] = self.scrape_failures[name] = self.request_errors[name] = 0
        self._epoch[name] = 0
        self._waits[name] = set()

    def remove(self, name: str) -> None:
        """Stop watching engine ``name`` (it left and nothing runs there any more)."""
        for table in (self.up, self.failures, self.scrape_failures, self.request_errors):
            table.pop(name, None)
        self.ejected_because.pop(name, None)
        self._epoch.pop(name, None)
        self._waits.pop(name, None)

    def rest(self, name: str) -> None:
        """Engine ``name`` is being put to sleep or stopped (on a card): no health
        checks or scrapes of it until :meth:`resume`, and none in flight counts."""
        if name in self.up:
            self.resting.add(name)
            self._epoch[name] += 1
            self.failures[name] = 0

    def resume(self, name: str) -> None:
        """Engine ``name`` was woken and answered its health check: up, watched again."""
        self.resting.discard(name)
        if name in self.up:
            self._epoch[name] += 1
            self._record(name, True)

    async def run(self) -> None:
        """Check health every ``health_interval_s`` and scrape loads every
        ``scrape_interval_s`` until cancelled."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(_every, self.settings.upstream.health_interval_s, self.check_health)
            tg.start_soon(_every, self.settings.upstream.scrape_interval_s, self.scrape_loads)

    async def check_once(self) -> None:
        """One round: the health of every engine, then the loads of the up ones."""
        await self.check_health()
        await self.scrape_loads()

    async def check_health(self) -> None:
        """Ask every engine's ``/health`` concurrently and eject or readmit."""
        epochs = dict(self._epoch)
        results: dict[str, bool] = {}
        async with anyio.create_task_group() as tg:
            for engine in list(self.pool.engines.values()):
                if engine.name in self.resting:
                    continue
                tg.start_soon(_probe, engine, self.settings.upstream.health_timeout_s, results)
        for name, ok in results.items():
            if name in epochs and self._epoch.get(name) == epochs[name]:
                self._record(name, ok)
        self.health_rounds += 1

    async def scrape_loads(self) -> None:
        """Scrape the up engines' ``/metrics`` concurrently into the scheduler."""
        loads: dict[str, EngineLoad] = {}
        async with anyio.create_task_group() as tg:
            for name, engine in list(self.pool.engines.items()):
                if self.up.get(name) and name not in self.resting:
                    tg.start_soon(self._scrape, engine, loads)
        for name, load in loads.items():
            if name in self.up:  # not gone while it was scraped
                self.scheduler.observe_load(name, load)

    def mark_failed(self, name: str, reason: str = "a request could not reach it") -> None:
        """The request path found ``name`` unusable (``reason``): eject it now."""
        if name not in self.up:
            return  # it left discovery meanwhile
        self._epoch[name] += 1
        self.failures[name] = max(self.failures[name], self.settings.upstream.unhealthy_after)
        if self.up[name]:
            logger.warning("engine %s ejected: %s", name, reason)
            self.ejected_because[name] = reason
            self._set_up(name, False)

    def request_failed(self, name: str, error: UpstreamError) -> None:
        """A request on ``name`` failed with ``error`` (outlier detection)."""
        if name not in self.up:
            return
        self.request_errors[name] += 1
        if isinstance(error, EngineTimeout):
            self.mark_failed(name, f"a stream timed out ({error})")
        elif self.request_errors[name] >= self.settings.upstream.outlier_consecutive_errors:
            self.mark_failed(name, f"{self.request_errors[name]} requests failed in a row")

    def answered(self, name: str) -> None:
        """A request's response from ``name`` began."""
        self.answered_at[name] = time.monotonic()

    def answered_within(self, name: str, seconds: float) -> bool:
        """Whether ``name`` answered (health check or request) in the last ``seconds``."""
        at = self.answered_at.get(name)
        return at is not None and time.monotonic() - at <= seconds

    def awaiting(self, name: str) -> AnswerWait:
        """A watch for a request waiting for ``name``'s answer to begin (its response
        head, or its first chunk), to use as ``with``: the block is cancelled if
        ``name`` is ejected before it ends or :meth:`AnswerWait.began` is called, and
        at its first wait if ``name`` is out already when it begins."""
        return AnswerWait(name, self)

    def request_succeeded(self, name: str) -> None:
        if name in self.request_errors:
            self.request_errors[name] = 0

    def _record(self, name: str, ok: bool) -> None:
        if ok:
            self.answered(name)
            self.failures[name] = 0
            if not self.up[name]:
                logger.info("engine %s readmitted: its health check passed", name)
                self._set_up(name, True)
            return
        self.failures[name] += 1
        if self.up[name] and self.failures[name] >= self.settings.upstream.unhealthy_after:
            reason = f"{self.failures[name]} health checks failed in a row"
            logger.warning("engine %s ejected: %s", name, reason)
            self.ejected_because[name] = reason
            self._set_up(name, False)

    def why_unusable(self, name: str) -> str:
        """Why requests cannot go to ``name`` now, in a few words for a client."""
        if name not in self.up:
            return "left discovery"
        if not self.up[name]:
            return f"ejected: {self.ejected_because.get(name, 'unreachable')}"
        if self.failures[name]:
            return f"{self.failures[name]} health checks failed in a row"
        return "not reached yet"

    def _set_up(self, name: str, up: bool) -> None:
        self.up[name] = up
        self.scheduler.set_engine_up(name, up)
        if not up:
            self._cut_waits(name)
        if self.on_change is not None:
            self.on_change(name, up)

    def _watch(self, wait: AnswerWait) -> bool:
        """Cut ``wait`` when its engine is ejected (whether it is watched now); at
        once if the engine is out already."""
        if self.up.get(wait.engine) is False:
            wait.eject(self.why_unusable(wait.engine))
            return False
        waits = self._waits.get(wait.engine)
        if waits is None:
            return False  # an engine that left discovery: nothing will eject it
        waits.add(wait)
        return True

    def _unwatch(self, wait: AnswerWait) -> None:
        waits = self._waits.get(wait.engine)
        if waits is not None:
            waits.discard(wait)

    def _cut_waits(self, name: str) -> None:
        """Cut every request still waiting for ``name``'s answer to begin: nothing of
        its answer came yet, so the request path can send it elsewhere."""
        waits = self._waits.get(name)
        if not waits:
            return
        logger.warning(
            "engine %s: %d requests waiting for its answer taken off it", name, len(waits)
        )
        reason = self.why_unusable(name)
        cut = list(waits)
        waits.clear()
        for wait in cut:
            wait.eject(reason)

    async def _scrape(self, engine: EngineClient, loads: dict[str, EngineLoad]) -> None:
        try:
            loads[engine.name] = await engine.load()
        except UpstreamError as exc:
            if engine.name not in self.scrape_failures:
                return
            self.scrape_failures[engine.name] += 1
            logger.warning(
                "engine %s: /metrics scrape failed (%d so far): %s",
                engine.name,
                self.scrape_failures[engine.name],
                exc,
            )


async def _probe(engine: EngineClient, timeout_s: float, results: dict[str, bool]) -> None:
    results[engine.name] = await engine.health(timeout_s)


async def _every(interval_s: float, step: Callable[[], Awaitable[None]]) -> None:
    while True:
        await step()
        await anyio.sleep(interval_s)
