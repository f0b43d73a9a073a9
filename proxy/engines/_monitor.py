"""Health checks and ``/metrics`` scrapes of every engine, fed to the scheduler.

- An engine whose health check fails ``settings.unhealthy_after`` times in a row is
  ejected (``scheduler.set_engine_up(name, False)``); one passing check readmits it.
- :meth:`EngineMonitor.mark_failed` ejects at once, for the request path that saw
  the engine refuse a connection. Health answers to checks sent before that call
  are ignored, so a check already in flight cannot readmit the engine.
- Outlier detection on the request path, after Envoy's: a stream that timed out
  (:class:`~proxy.engines.EngineTimeout`, a hung engine) ejects its engine at
  once; other failures (a broken stream, a 5xx) eject it after
  ``settings.outlier_consecutive_errors`` in a row with no success between
  (:meth:`EngineMonitor.request_failed`, :meth:`EngineMonitor.request_succeeded`).
  Recovery is by health check, as above.
- :meth:`EngineMonitor.answered_within` says whether an engine answered lately (a
  passing health check, or a request whose response began): a connect timeout on
  such an engine is taken for the proxy's own delay (a burst of new streams on a
  busy event loop), not a reason to eject it (:mod:`proxy.api.forward`).
- The loads of up engines go to ``scheduler.observe_load``. A failed scrape is
  logged at warning and counted in ``scrape_failures``; the scheduler keeps the
  last load it was given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
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
        for name in pool.engines:
            self.add(name)

    def add(self, name: str) -> None:
        """Watch engine ``name`` too (it joined; it starts up, as in the scheduler)."""
        if name in self.up:
            return
        self.up[name] = True
        self.failures[name] = self.scrape_failures[name] = self.request_errors[name] = 0
        self._epoch[name] = 0

    def remove(self, name: str) -> None:
        """Stop watching engine ``name`` (it left and nothing runs there any more)."""
        for table in (self.up, self.failures, self.scrape_failures, self.request_errors):
            table.pop(name, None)
        self.ejected_because.pop(name, None)
        self._epoch.pop(name, None)

    async def run(self) -> None:
        """Check health every ``health_interval_s`` and scrape loads every
        ``scrape_interval_s`` until cancelled."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(_every, self.settings.health_interval_s, self.check_health)
            tg.start_soon(_every, self.settings.scrape_interval_s, self.scrape_loads)

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
                tg.start_soon(_probe, engine, results)
        for name, ok in results.items():
            if name in epochs and self._epoch.get(name) == epochs[name]:
                self._record(name, ok)
        self.health_rounds += 1

    async def scrape_loads(self) -> None:
        """Scrape the up engines' ``/metrics`` concurrently into the scheduler."""
        loads: dict[str, EngineLoad] = {}
        async with anyio.create_task_group() as tg:
            for name, engine in list(self.pool.engines.items()):
                if self.up.get(name):
                    tg.start_soon(self._scrape, engine, loads)
        for name, load in loads.items():
            if name in self.up:  # not gone while it was scraped
                self.scheduler.observe_load(name, load)

    def mark_failed(self, name: str, reason: str = "a request could not reach it") -> None:
        """The request path found ``name`` unusable (``reason``): eject it now."""
        if name not in self.up:
            return  # it left discovery meanwhile
        self._epoch[name] += 1
        self.failures[name] = max(self.failures[name], self.settings.unhealthy_after)
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
        elif self.request_errors[name] >= self.settings.outlier_consecutive_errors:
            self.mark_failed(name, f"{self.request_errors[name]} requests failed in a row")

    def answered(self, name: str) -> None:
        """A request's response from ``name`` began."""
        self.answered_at[name] = time.monotonic()

    def answered_within(self, name: str, seconds: float) -> bool:
        """Whether ``name`` answered (health check or request) in the last ``seconds``."""
        at = self.answered_at.get(name)
        return at is not None and time.monotonic() - at <= seconds

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
        if self.up[name] and self.failures[name] >= self.settings.unhealthy_after:
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
        if self.on_change is not None:
            self.on_change(name, up)

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


async def _probe(engine: EngineClient, results: dict[str, bool]) -> None:
    results[engine.name] = await engine.health()


async def _every(interval_s: float, step: Callable[[], Awaitable[None]]) -> None:
    while True:
        await step()
        await anyio.sleep(interval_s)
