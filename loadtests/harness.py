"""The workload-evidence harness: a workload (:mod:`loadtests.workload_file`) driven
over HTTP against one arm, every request recorded (:class:`loadtests.client.Record`).

Every traffic class runs at once: an open-loop class sends at its arrival times
(:mod:`loadtests.arrivals`, seeded), a closed-loop class keeps ``concurrency``
requests outstanding, sending the next as one finishes. Prompts are real prose from
Python's documentation (:mod:`loadtests.corpus`), the same in every arm for the same
seed, each starting with its own header so no two share a prefix.

An arm is where requests go (:data:`Route`). Direct, every class goes to the engines'
``/v1`` in turn (round robin); through a proxy, a ``chat`` route goes to its ``/v1``
and a ``batch`` route to its ``/batch/v1``. At the end of a run the closed-loop
streams still open are closed (the client hangs up) and marked so: they count in no
figure. Open-loop requests are waited for.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtests.arrivals import gamma_times, trace_times
from loadtests.client import Record, close, stream
from loadtests.corpus import SETS, as_prompt, messages
from loadtests.workload_file import TrafficClass, Workload

Route = Callable[[TrafficClass], str]
"""The full URL of a class's next request."""

PATHS = {"chat": "/chat/completions", "completions": "/completions"}


def direct_route(engines: list[str]) -> Route:
    """Round robin over ``engines`` (base URLs) for every class, on ``/v1``."""
    turn = itertools.count()
    return lambda cls: f"{engines[next(turn) % len(engines)]}/v1{PATHS[cls.api]}"


def proxy_route(proxy: str) -> Route:
    """A ``chat`` route to the proxy's ``/v1``, a ``batch`` route to its ``/batch/v1``."""
    prefixes = {"chat": "/v1", "batch": "/batch/v1"}
    return lambda cls: f"{proxy}{prefixes[cls.route]}{PATHS[cls.api]}"


def send_times(workload: Workload, cls: TrafficClass) -> list[float]:
    """An open-loop class's send times, seconds from the start of a run."""
    a, duration = cls.arrival, workload.plan.duration_s
    if a.process == "closed":
        raise ValueError(f"{cls.name}: a closed loop has no send times")
    if a.process == "trace":
        assert a.trace is not None
        return trace_times(a.trace, duration)
    return gamma_times(
        a.rate, a.burstiness, duration, workload.seed + zlib.crc32(cls.name.encode())
    )


def body(workload: Workload, cls: TrafficClass, i: int) -> dict[str, Any]:
    """Request ``i`` of ``cls``: its prompt source's messages (:func:`messages`), the
    first starting with a header of its own so no two requests share a prefix."""
    seed = workload.seed * 1_000_003 + zlib.crc32(cls.name.encode())
    start = seed + 104_729 * i if cls.prompt_chars is not None else seed
    chat = messages(cls.prompt_source, i, start, cls.prompt_chars)
    passage = SETS[cls.prompt_source][0] in ("topics", "documents")
    header = f"{cls.name} {i}: what does this say?" if passage else f"{cls.name} {i}."
    chat[0] = {**chat[0], "content": f"{header}\n\n{chat[0]['content']}"}
    out: dict[str, Any] = {
        "model": workload.model,
        "max_tokens": cls.max_tokens,
        "temperature": cls.temperature,
    }
    if cls.api == "chat":
        out["messages"] = chat
    else:
        out["prompt"] = as_prompt(chat)
    return out


@dataclass
class ArmRun:
    """One run of a workload against one arm: the records by class, and its clock."""

    started_at: float
    records: dict[str, list[Record]] = field(default_factory=dict)

    def window(self, workload: Workload) -> tuple[float, float]:
        """The window of the latencies (monotonic seconds): after warm-up, to the end.
        Throughput is counted over the whole run: every arm starts empty, and a closed
        loop's completions come in waves that a shorter window cuts unevenly."""
        plan = workload.plan
        return self.started_at + plan.warmup_s, self.started_at + plan.duration_s


def new_run(workload: Workload) -> ArmRun:
    """An empty run that starts now."""
    return ArmRun(time.monotonic(), {cls.name: [] for cls in workload.classes})


async def run_arm(workload: Workload, route: Route, http: httpx.AsyncClient, run: ArmRun) -> ArmRun:
    """Drive ``workload`` over ``route`` from ``run.started_at`` for the plan's
    duration, adding every record to ``run`` as it is sent; ``run``."""
    end = run.started_at + workload.plan.duration_s
    open_streams: dict[str, asyncio.Task[Record]] = {}
    senders, workers = [], []
    for cls in workload.classes:
        if cls.arrival.process == "closed":
            counter = itertools.count()
            workers += [
                asyncio.create_task(_worker(workload, cls, route, http, run, counter, open_streams))
                for _ in range(cls.arrival.concurrency)
            ]
        else:
            senders.append(asyncio.create_task(_open_loop(workload, cls, route, http, run)))
    await asyncio.sleep(max(0.0, end - time.monotonic()))
    for worker in workers:
        worker.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    for records in run.records.values():
        for record in records:
            task = open_streams.get(record.id)
            if task is not None:
                await close(record, task)
    await asyncio.gather(*senders)
    return run


async def _open_loop(
    workload: Workload, cls: TrafficClass, route: Route, http: httpx.AsyncClient, run: ArmRun
) -> None:
    tasks = []
    for i, at in enumerate(send_times(workload, cls)):
        await asyncio.sleep(max(0.0, run.started_at + at - time.monotonic()))
        record = _record(cls, i, route(cls))
        run.records[cls.name].append(record)
        tasks.append(asyncio.create_task(stream(http, record, body(workload, cls, i))))
    await asyncio.gather(*tasks)


async def _worker(
    workload: Workload,
    cls: TrafficClass,
    route: Route,
    http: httpx.AsyncClient,
    run: ArmRun,
    counter: Iterator[int],
    open_streams: dict[str, asyncio.Task[Record]],
) -> None:
    while True:
        i = next(counter)
        record = _record(cls, i, route(cls))
        run.records[cls.name].append(record)
        task = asyncio.create_task(stream(http, record, body(workload, cls, i)))
        open_streams[record.id] = task
        await asyncio.shield(task)
        del open_streams[record.id]


def _record(cls: TrafficClass, i: int, url: str) -> Record:
    return Record(
        id=f"{cls.name}-{i}",
        kind=cls.name,
        url=url,
        prompt_tokens_sent=0,
        max_tokens=cls.max_tokens,
        sent_at=0.0,
    )
