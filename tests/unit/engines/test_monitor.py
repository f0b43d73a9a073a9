"""Health checks eject and readmit engines; load scrapes reach the scheduler."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import httpx
import pytest

from proxy.clock import VirtualClock
from proxy.config import EngineConfig
from proxy.engines import EngineMonitor, EnginePool
from proxy.scheduler import EngineLoad, Scheduler

from .helpers import (
    METRICS_TEXT,
    FakeEngines,
    answer,
    engine_config,
    make_settings,
    wait_until,
)

pytestmark = pytest.mark.anyio

NAMES = ("a", "b")


class Health:
    """``/health`` of each engine, switchable by the test."""

    def __init__(self, fake: FakeEngines) -> None:
        self.ok = dict.fromkeys(NAMES, True)
        for name in NAMES:
            fake.on(name, "/health", self._respond)
            fake.on(name, "/metrics", answer(text=METRICS_TEXT))

    def _respond(self, request: httpx.Request) -> httpx.Response:
        name = request.url.host.split(".")[0]
        return httpx.Response(200 if self.ok[name] else 503)


@dataclass
class Rig:
    fake: FakeEngines
    health: Health
    scheduler: Scheduler
    monitor: EngineMonitor
    changes: list[tuple[str, bool]]

    def scheduler_up(self, name: str) -> bool:
        return self.scheduler.engines[name].up


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    fake = FakeEngines()
    health = Health(fake)
    configs = tuple(engine_config(n, models=("tiny",)) for n in NAMES)
    settings = make_settings(*configs, unhealthy_after=3)
    engines = [EngineConfig(name=n, models=frozenset({"tiny"})) for n in NAMES]
    scheduler = Scheduler(engines, VirtualClock())
    changes: list[tuple[str, bool]] = []
    async with fake.client(settings) as http:
        pool = EnginePool(configs, http)
        monitor = EngineMonitor(pool, scheduler, settings, lambda n, up: changes.append((n, up)))
        yield Rig(fake, health, scheduler, monitor, changes)


async def test_ejects_after_n_failed_checks_and_readmits_after_one_success(rig: Rig) -> None:
    rig.health.ok["a"] = False
    for _ in range(2):
        await rig.monitor.check_once()
        assert rig.monitor.up["a"] and rig.scheduler_up("a")
    await rig.monitor.check_once()
    assert rig.monitor.up == {"a": False, "b": True}
    assert not rig.scheduler_up("a")
    assert rig.changes == [("a", False)]
    await rig.monitor.check_once()  # still failing: no second ejection
    assert rig.changes == [("a", False)]

    rig.health.ok["a"] = True
    await rig.monitor.check_once()
    assert rig.monitor.up == {"a": True, "b": True}
    assert rig.scheduler_up("a")
    assert rig.changes == [("a", False), ("a", True)]
    assert rig.monitor.failures == {"a": 0, "b": 0}
    assert rig.monitor.health_rounds == 5


async def test_a_success_resets_the_count_of_failures(rig: Rig) -> None:
    for ok in (False, False, True, False, False):
        rig.health.ok["a"] = ok
        await rig.monitor.check_once()
    assert rig.monitor.up["a"]
    assert rig.changes == []


async def test_loads_of_up_engines_reach_the_scheduler(rig: Rig) -> None:
    await rig.monitor.check_once()
    for name in NAMES:
        assert rig.scheduler.engines[name].load == EngineLoad(0.625, 7, 7)
    assert rig.monitor.scrape_failures == {"a": 0, "b": 0}


async def test_down_engines_are_not_scraped(rig: Rig) -> None:
    rig.monitor.mark_failed("a")
    await rig.monitor.scrape_loads()
    assert rig.fake.calls("a", "/metrics") == 0
    assert rig.fake.calls("b", "/metrics") == 1
    assert rig.scheduler.engines["a"].load == EngineLoad()


async def test_a_failed_scrape_is_logged_and_counted(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    await rig.monitor.check_once()
    rig.fake.on("a", "/metrics", answer(200, text="<html>proxy error</html>"))
    caplog.set_level(logging.WARNING, logger="proxy.engines")
    await rig.monitor.check_once()
    await rig.monitor.check_once()
    assert rig.monitor.scrape_failures == {"a": 2, "b": 0}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2
    assert all(m.startswith("engine a: /metrics scrape failed") for m in warnings)
    assert "(2 so far)" in warnings[1]
    assert rig.scheduler.engines["a"].load == EngineLoad(0.625, 7, 7)  # the last good one
    assert rig.monitor.up["a"]  # a scrape failure alone does not eject


async def test_mark_failed_ejects_at_once_and_a_check_readmits(rig: Rig) -> None:
    rig.monitor.mark_failed("b")
    assert rig.monitor.up == {"a": True, "b": False}
    assert not rig.scheduler_up("b")
    rig.monitor.mark_failed("b")
    assert rig.changes == [("b", False)]
    await rig.monitor.check_once()
    assert rig.monitor.up["b"] and rig.scheduler_up("b")
    assert rig.changes == [("b", False), ("b", True)]


async def test_a_check_in_flight_when_marked_failed_does_not_readmit(rig: Rig) -> None:
    asked = anyio.Event()
    release = anyio.Event()

    async def slow_ok(request: httpx.Request) -> httpx.Response:
        asked.set()
        await release.wait()
        return httpx.Response(200)

    rig.fake.on("a", "/health", slow_ok)
    async with anyio.create_task_group() as tg:
        tg.start_soon(rig.monitor.check_health)
        await asked.wait()
        rig.monitor.mark_failed("a")
        release.set()
    assert not rig.monitor.up["a"]
    await rig.monitor.check_health()  # asked after the failure: counts
    assert rig.monitor.up["a"]


async def test_run_checks_and_scrapes_until_cancelled(rig: Rig) -> None:
    rig.health.ok["b"] = False
    async with anyio.create_task_group() as tg:
        tg.start_soon(rig.monitor.run)
        await wait_until(
            lambda: rig.monitor.health_rounds >= 4 and rig.fake.calls("a", "/metrics") >= 2
        )
        tg.cancel_scope.cancel()
    assert rig.monitor.up == {"a": True, "b": False}
    assert rig.scheduler.engines["a"].load == EngineLoad(0.625, 7, 7)
