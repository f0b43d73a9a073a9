"""The relay of one upstream answer: events in order, and a backlog of events read
in one chunk never holds the event loop."""

from __future__ import annotations

import itertools

import anyio
import httpx
import pytest

from proxy.admission import Admission, Admitted
from proxy.api.prompts import PromptCount, PromptCounter
from proxy.api.relay import BATCH, Relay, Services
from proxy.api.sse import SSEEvent
from proxy.api.ticket import Ticket
from proxy.clock import VirtualClock
from proxy.config import EngineConfig
from proxy.engines import EnginePool
from proxy.metrics import ProxyMetrics
from proxy.openai.request import ChatRequest, StreamWish
from proxy.scheduler import Job, Scheduler, TrafficClass

from .helpers import completion_events

pytestmark = pytest.mark.anyio

BACKLOG = 200


def relay_of(body: bytes) -> tuple[Relay, Admission]:
    clock = VirtualClock()
    scheduler = Scheduler([EngineConfig(name="e", models=frozenset({"m"}))], clock)
    admission = Admission(scheduler)
    job = Job(id="j", cls=TrafficClass.INTERACTIVE, model="m", prompt_tokens=5, arrival=0.0)
    scheduler.submit(job)
    (dispatch,) = scheduler.dispatch()
    response = httpx.Response(200, stream=httpx.ByteStream(body))
    metrics = ProxyMetrics(scheduler, ttft_target_s=0.3)
    req = ChatRequest(
        path="/v1/completions", cls=TrafficClass.INTERACTIVE, model="m", messages=None,
        prompt="p", text="p", wish=StreamWish(True, False), affinity="a", upstream={},
    )  # fmt: skip
    pool = EnginePool([], httpx.AsyncClient())
    services = Services(admission, metrics, clock, PromptCounter(pool, admission.engines_up_for))
    ticket = Ticket("j", req, 0.0, PromptCount(5, estimated=True))
    return Relay(ticket, Admitted.of(dispatch), response, services), admission


async def test_a_backlog_read_at_once_is_passed_on_in_batches_with_other_tasks_between() -> None:
    """Hundreds of events in one read (the engine ran ahead of the proxy): they are
    passed on in order, at most ``BATCH`` at a time (one write each for a streaming
    client), and other tasks — a client's hang-up, other requests — run between
    every two batches."""
    pieces = [f" t{i}" for i in range(BACKLOG)]
    body = b"".join(completion_events(pieces))
    relay, _ = relay_of(body)
    ticks = 0
    batches: list[tuple[int, list[SSEEvent]]] = []

    async def other_task() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as group:
        group.start_soon(other_task)
        await anyio.lowlevel.checkpoint()

        async def deliver(events: list[SSEEvent]) -> None:
            batches.append((ticks, list(events)))

        await relay.pump(deliver)
        group.cancel_scope.cancel()
    events = [event for _, batch in batches for event in batch]
    assert b"".join(e.raw for e in events) == body  # all of it, in order
    assert relay.stats.events == len(events) == BACKLOG + 3  # the usage chunk and [DONE]
    assert [len(batch) for _, batch in batches] == [BATCH] * 6 + [BACKLOG + 3 - 6 * BATCH]
    # The other task ran at least once between any two batches.
    seen = [ticks for ticks, _ in batches]
    assert all(later > earlier for earlier, later in itertools.pairwise(seen))
