"""Reads are reads: ``GET /metrics``, ``/turn``, ``/turn/log``, ``/turn/history``
and ``/status`` never run the scheduler, so a GET can neither dispatch a queued job
nor change what the scheduler holds (its turn history included)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from proxy.clock import VirtualClock
from proxy.scheduler import Job, Phase, TrafficClass
from proxy.server import ProxyState, build, create_app, shutdown

from .helpers import FakeEngines

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

READS = ("/metrics", "/turn", "/turn?format=text", "/turn/log", "/turn/history", "/status")


def snapshot(state: ProxyState) -> Any:
    s = state.scheduler
    engines = {
        n: (
            e.turn,
            e.held_reason,
            dict(e.turn_seconds),
            e.budget.tokens,
            e.turn_history.seconds(0.0, 0.0, e.turn),
        )
        for n, e in s.engines.items()
    }
    return (
        state.admission.report(),
        list(s.log),
        {c: [j.id for j in q] for c, q in s.queues.items()},
        {j.id: (j.phase, j.engine, j.held) for j in s.jobs.values()},
        engines,
    )


async def test_reads_never_dispatch_a_queued_job_nor_change_the_scheduler() -> None:
    engines = FakeEngines()
    settings = engines.settings()
    clock = VirtualClock()
    transport = httpx.MockTransport(engines)
    app = create_app(settings, transport=transport, clock=clock)
    # Built, never started: no background loop runs, so only the GETs could act.
    state = await build(settings, transport, clock)
    app.state.proxy = state
    runs: list[str] = []
    for name in ("dispatch", "tick"):
        method = getattr(state.scheduler, name)
        setattr(state.scheduler, name, lambda m=method, n=name: runs.append(n) or m())
    try:
        job = Job(id="q", cls=TrafficClass.INTERACTIVE, model="m", prompt_tokens=10, arrival=0)
        state.scheduler.submit(job)  # queued; the next dispatch would send it at once
        clock.advance(5.0)
        before, calls = snapshot(state), len(engines.calls)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p")
        async with client:
            responses = [await client.get(path) for path in READS]
        assert [r.status_code for r in responses] == [200] * len(READS)
        assert runs == []
        assert job.phase is Phase.QUEUED
        assert snapshot(state) == before
        assert len(engines.calls) == calls
        # The report still counts the time up to now, without charging it.
        report = responses[1].json()["engines"][0]
        assert sum(report["turn_seconds"].values()) == pytest.approx(5.0)
    finally:
        await shutdown(state)
