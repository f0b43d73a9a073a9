"""The runner runs each job as its tenant's: every line carries the tenant and the
job's flow; the tenant's ``batch_jobs``, ``batch_lines`` and requests per minute
hold its work and never fail it; and a short job that comes after a long one of
another tenant goes straight through the runner beside it.

The request path is a fake engine that keeps every line until the test lets it go,
so each test sees exactly what the runner has handed on at any moment."""

from __future__ import annotations

import functools
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from proxy.batch.runner import BatchRunner, RunnerLimits
from proxy.batch.sqlite import SQLiteStore
from proxy.batch.store import BatchRecord, NewBatch
from proxy.clock import WallClock
from proxy.config import Tenant, TenantLimits
from proxy.metrics import BatchMetrics
from proxy.openai.answers import Answer
from proxy.openai.request import ChatRequest
from proxy.scheduler.limits import TenantMeter
from tests.unit.batch.test_runner import CHAT, OK, jsonl

pytestmark = pytest.mark.anyio


@dataclass
class Call:
    """One line in the fake engine: its job, its request, and the event that answers it."""

    job: str
    req: ChatRequest
    answer: anyio.Event = field(default_factory=anyio.Event)


class Changes:
    """What a test waits on: told of every change it watches (a line in or out of
    the engine, a hold), so that a wait for a state ends when the state comes."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def note(self) -> None:
        self._event.set()
        self._event = anyio.Event()

    async def until(self, done: Callable[[], bool]) -> None:
        """Until ``done()`` (the test's deadline bounds it)."""
        while not done():
            await self._event.wait()


class HeldEngine:
    """Keeps every line until :meth:`release` (or ``auto``: answers at once); counts
    what is in it by job and by tenant, and the most of each at once. Counted against
    the tenant's limits as the forwarder counts a request (``meter``)."""

    def __init__(self, changes: Changes, meter: TenantMeter, auto: bool = False) -> None:
        self.changes = changes
        self.meter = meter
        self.auto = auto
        self.calls: list[Call] = []
        self.inside: list[Call] = []
        self.most: Counter[str] = Counter()
        self.starts: list[tuple[float, str]] = []

    def by(self, what: Callable[[Call], str]) -> Counter[str]:
        return Counter(what(c) for c in self.inside)

    async def complete(self, req: ChatRequest, job_id: str) -> Answer:
        call = Call(job_id.split("/")[0], req)
        self.calls.append(call)
        self.inside.append(call)
        self.starts.append((time.monotonic(), req.tenant.name))
        for key, n in (self.by(lambda c: c.job) + self.by(lambda c: c.req.tenant.name)).items():
            self.most[key] = max(self.most[key], n)
        self.meter.started(req.tenant, 1)
        self.changes.note()
        try:
            if not self.auto:
                await call.answer.wait()
        finally:
            self.inside.remove(call)
            self.meter.finished(req.tenant, 1)
            self.changes.note()
        return Answer.of(200, OK)

    def release(self, call: Call) -> None:
        call.answer.set()

    def release_all(self) -> None:
        self.auto = True
        for call in list(self.inside):
            call.answer.set()


TENANTS = {
    "a": Tenant(name="a", weight=2.0, configured=True),
    "lines3": Tenant(name="lines3", limits=TenantLimits(batch_lines=3), configured=True),
    "jobs1": Tenant(name="jobs1", limits=TenantLimits(batch_jobs=1), configured=True),
}


def more_than(calls: list[Call], n: int) -> bool:
    return len(calls) > n


def tenant_of(name: str) -> Tenant:
    return TENANTS.get(name, Tenant(name=name))


@dataclass
class Rig:
    store: SQLiteStore
    runner: BatchRunner
    engine: HeldEngine
    held: Counter[tuple[str, str]]
    changes: Changes
    tmp_path: Path

    async def add(self, batch_id: str, tenant: str, lines: int) -> None:
        """A job of ``tenant`` as the routes store it: its file uploaded, the job
        ``validating`` (the runner reads its lines in)."""
        source = self.tmp_path / f"{batch_id}.jsonl"
        source.write_bytes(jsonl(lines))
        uploaded = await self.store.add_file("batch", source.name, source)
        new = NewBatch(batch_id, CHAT, uploaded.id, "24h", 86400, None, tenant)
        await self.store.add_batch(new)

    async def job(self, batch_id: str) -> BatchRecord:
        found = await self.store.get_batch(batch_id)
        assert found is not None
        return found

    async def until(self, done: Callable[[], bool]) -> None:
        await self.changes.until(done)

    async def finished(self, *batch_ids: str) -> list[BatchRecord]:
        while True:
            jobs = [await self.job(b) for b in batch_ids]
            if all(j.status == "completed" for j in jobs):
                return jobs
            await anyio.sleep(0.01)


@asynccontextmanager
async def rig(
    tmp_path: Path, window: int = 8, meter: TenantMeter | None = None, auto: bool = False
) -> AsyncIterator[Rig]:
    store = SQLiteStore(tmp_path / "b.db", time.time)
    await store.open()
    meter = meter or TenantMeter(WallClock())
    changes = Changes()
    engine = HeldEngine(changes, meter, auto)
    held: Counter[tuple[str, str]] = Counter()

    def limited(tenant: str, limit: str) -> None:
        held[(tenant, limit)] += 1
        changes.note()

    limits = RunnerLimits(
        window=window, max_attempts=1, backoff_s=0.001, poll_s=0.01, max_lines=20_000
    )
    runner = BatchRunner(
        store, engine.complete, BatchMetrics(), limits, time.time,
        tenant_of=tenant_of, meter=meter, limited=limited,
    )  # fmt: skip
    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as group:
                group.start_soon(runner.run)
                yield Rig(store, runner, engine, held, changes, tmp_path)
                engine.release_all()
                group.cancel_scope.cancel()
    finally:
        await store.close()


async def test_each_line_goes_as_its_jobs_tenant_in_the_jobs_flow(tmp_path: Path) -> None:
    async with rig(tmp_path, auto=True) as r:
        await r.add("batch_a", "a", 5)
        await r.add("batch_anon", "", 3)
        done = await r.finished("batch_a", "batch_anon")
    assert [(j.tenant, j.completed) for j in done] == [("a", 5), ("", 3)]
    seen = Counter((c.job, c.req.tenant, c.req.flow) for c in r.engine.calls)
    assert seen == {
        ("batch_a", TENANTS["a"], "batch_a"): 5,  # the configured tenant: weight 2
        ("batch_anon", Tenant(name=""), "batch_anon"): 3,
    }


async def test_batch_lines_holds_a_tenants_lines_across_its_jobs_and_shares_them(
    tmp_path: Path,
) -> None:
    """Two jobs of a tenant with ``batch_lines: 3`` (a window of 8 each): never more
    than 3 of its lines in the engine; once both feed, a freed slot goes to the job
    with fewer lines in (the second, at the first freed: not the first job, which
    waited longer), so their counts never differ by more than one; every line
    completes."""
    async with rig(tmp_path, window=8) as r:
        await r.add("batch_1", "lines3", 12)
        await r.until(lambda: len(r.engine.inside) == 3)
        await r.add("batch_2", "lines3", 12)
        await r.until(lambda: r.held[("lines3", "batch_lines")] >= 2)  # both feeders wait
        assert r.engine.by(lambda c: c.job) == {"batch_1": 3}
        balanced = []
        while len(r.engine.calls) < 20:  # until one job is near its end
            before = len(r.engine.calls)
            r.engine.release(r.engine.inside[0])  # the oldest line answers
            await r.until(functools.partial(more_than, r.engine.calls, before))  # the next
            assert len(r.engine.calls) == before + 1 and len(r.engine.inside) == 3
            per_job = r.engine.by(lambda c: c.job)
            balanced.append(abs(per_job["batch_1"] - per_job["batch_2"]) <= 1)
        assert len(balanced) >= 10 and all(balanced), balanced
        r.engine.release_all()
        done = await r.finished("batch_1", "batch_2")
    assert [(j.completed, j.failed) for j in done] == [(12, 0), (12, 0)]
    assert r.engine.most["lines3"] == 3
    assert r.held[("lines3", "batch_lines")] >= 2


async def test_batch_jobs_holds_a_job_in_progress_until_one_ends_and_no_other_tenant(
    tmp_path: Path,
) -> None:
    async with rig(tmp_path) as r:
        await r.add("batch_1", "jobs1", 4)
        await r.until(lambda: len(r.engine.inside) == 4)
        await r.add("batch_2", "jobs1", 4)
        await r.add("batch_other", "a", 3)
        waiting = await r.job("batch_2")
        await r.until(lambda: r.runner.waiting(waiting))
        await r.until(lambda: r.engine.by(lambda c: c.job)["batch_other"] == 3)
        assert (await r.job("batch_2")).status == "in_progress"
        assert r.engine.by(lambda c: c.job)["batch_2"] == 0
        assert r.held == {("jobs1", "batch_jobs"): 1}
        for call in [c for c in r.engine.inside if c.job == "batch_1"]:
            r.engine.release(call)
        await r.until(lambda: r.engine.by(lambda c: c.job)["batch_2"] == 4)
        assert not r.runner.waiting(waiting)
        r.engine.release_all()
        done = await r.finished("batch_1", "batch_2", "batch_other")
    assert [j.completed for j in done] == [4, 4, 3]
    assert all(j.failed == 0 for j in done)


async def test_requests_per_minute_spaces_lines_and_a_refused_line_waits(tmp_path: Path) -> None:
    """A tenant at 4 requests a "minute" of 0.4 s that spent them (as a client would)
    just before its job starts: the first line waits for the window to free, then the
    lines go 0.1 s apart; each held line is counted once; none fails."""
    window_s, rpm = 0.4, 4
    meter = TenantMeter(WallClock(), window_s=window_s)
    TENANTS["rpm4"] = Tenant(
        name="rpm4", limits=TenantLimits(requests_per_minute=rpm), configured=True
    )
    for _ in range(rpm):
        meter.started(TENANTS["rpm4"], 1)
        meter.finished(TENANTS["rpm4"], 0)
    spent_at = time.monotonic()
    async with rig(tmp_path, meter=meter, auto=True) as r:
        await r.add("batch_rpm", "rpm4", 6)
        [done] = await r.finished("batch_rpm")
    del TENANTS["rpm4"]
    assert (done.completed, done.failed) == (6, 0)
    starts = [t for t, _ in r.engine.starts]
    assert starts[0] >= spent_at + window_s - 0.01
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert min(gaps) >= window_s / rpm - 0.01, gaps
    assert r.held == {("rpm4", "requests_per_minute"): 6}


async def test_a_short_job_is_not_stuck_behind_a_long_one_of_another_tenant(
    tmp_path: Path,
) -> None:
    """A 10,000-line job of tenant a fills its window and none of its lines answers; a
    ten-line job of tenant b that comes after goes through the runner and completes
    meanwhile."""
    async with rig(tmp_path, window=64) as r:
        await r.add("batch_long", "a", 10_000)
        await r.until(lambda: len(r.engine.inside) == 64)
        await r.add("batch_short", "b", 10)
        await r.until(lambda: r.engine.by(lambda c: c.job)["batch_short"] == 10)
        for call in [c for c in r.engine.inside if c.job == "batch_short"]:
            r.engine.release(call)
        [short] = await r.finished("batch_short")
        long = await r.job("batch_long")
        assert (short.completed, long.status, long.completed) == (10, "in_progress", 0)
        assert r.engine.by(lambda c: c.job)["batch_long"] == 64
        await r.store.set_status("batch_long", "cancelling", ("in_progress",))
        r.runner.cancel("batch_long")
