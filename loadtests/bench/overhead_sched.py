"""The scheduler alone: time per dispatch decision with many queued batch jobs.

A :class:`~proxy.scheduler.Scheduler` over ``engines`` engines (one model) gets
``queued`` batch jobs of 1,000 prompt tokens and one first ``dispatch()`` (which
admits what the budgets allow; the rest stays queued). Then, ``repeats`` times: one
interactive job is submitted and ``dispatch()`` is called (the decision timed, both
calls together, with ``time.perf_counter``, and the CPU time the thread spent in
them, with ``time.thread_time``: on a shared machine the wall time's tail is the
other processes preempting this one, the CPU time's is not), then the job finishes. Python's
garbage collector runs as it would in the proxy (a collection that lands in a timed
decision counts: it is part of what a decision costs).

At the cap (:func:`cap_table`): every engine (``max_inflight`` 4) is full of chats
and ``waiting`` more chats are queued, held for the cap; each repeat submits one
more chat and calls ``dispatch()``, timed the same way. This is the proxy under
more chat than its engines take, where each event once walked every waiting chat.
"""

from __future__ import annotations

import time

from proxy.clock import VirtualClock
from proxy.config import EngineConfig
from proxy.scheduler import Job, Scheduler, TrafficClass

SIZES = (
    (4, 1000),
    (64, 1000),
    (4, 10000),
    (64, 10000),
    (4, 100000),
    (64, 100000),
)


def decision_times(
    engines: int, queued: int, repeats: int = 1000
) -> tuple[list[float], int, list[float]]:
    """Seconds per interactive submit + dispatch, sorted; the batch jobs still queued;
    and the CPU seconds of each, sorted."""
    clock = VirtualClock()
    configs = [EngineConfig(name=f"e{i}", models=frozenset({"m"})) for i in range(engines)]
    scheduler = Scheduler(configs, clock)
    for i in range(queued):
        scheduler.submit(
            Job(
                id=f"b{i}",
                cls=TrafficClass.BATCH,
                model="m",
                prompt_tokens=1000,
                arrival=clock.now(),
            )
        )
    scheduler.dispatch()
    waiting = len(scheduler.queues[TrafficClass.BATCH])
    times, cpu = [], []
    for i in range(repeats):
        job = Job(
            id=f"i{i}",
            cls=TrafficClass.INTERACTIVE,
            model="m",
            prompt_tokens=100,
            arrival=clock.now(),
        )
        start, start_cpu = time.perf_counter(), time.thread_time()
        scheduler.submit(job)
        scheduler.dispatch()
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
        scheduler.on_finished(job.id)
    return sorted(times), waiting, sorted(cpu)


def sched_table(sizes: tuple[tuple[int, int], ...] = SIZES) -> str:
    """A Markdown table of decision time p50/p99 (µs) per (engines, queued jobs)."""
    lines = [
        "| engines | batch jobs submitted | still queued | decision p50 µs | decision p99 µs "
        "| CPU p50 µs | CPU p99 µs |",
        "|---|---|---|---|---|---|---|",
    ]
    for engines, queued in sizes:
        times, waiting, cpu = decision_times(engines, queued)
        lines.append(f"| {engines} | {queued:,} | {waiting:,} | {_cells(times, cpu)} |")
    return "\n".join(lines)


def _cells(times: list[float], cpu: list[float]) -> str:
    """p50 and p99 (µs) of the sorted wall and CPU times, as table cells."""
    picks = [s[int(q * len(s))] for s in (times, cpu) for q in (0.5, 0.99)]
    return " | ".join(f"{x * 1e6:,.0f}" for x in picks)


CAP_SIZES = ((4, 1000), (64, 1000), (64, 10000))


def cap_times(engines: int, waiting: int, repeats: int = 1000) -> tuple[list[float], list[float]]:
    """Seconds per chat submit + dispatch with every engine at its cap and
    ``waiting`` chats queued, sorted; and the CPU seconds of each, sorted."""
    clock = VirtualClock()
    configs = [
        EngineConfig(name=f"e{i}", models=frozenset({"m"}), max_inflight=4) for i in range(engines)
    ]
    scheduler = Scheduler(configs, clock)
    for i in range(engines * 4 + waiting):
        scheduler.submit(
            Job(id=f"c{i}", cls=TrafficClass.INTERACTIVE, model="m", prompt_tokens=100,
                arrival=clock.now())
        )  # fmt: skip
    scheduler.dispatch()
    times, cpu = [], []
    for i in range(repeats):
        job = Job(
            id=f"x{i}", cls=TrafficClass.INTERACTIVE, model="m", prompt_tokens=100,
            arrival=clock.now(),
        )  # fmt: skip
        start, start_cpu = time.perf_counter(), time.thread_time()
        scheduler.submit(job)
        scheduler.dispatch()
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    return sorted(times), sorted(cpu)


def cap_table(sizes: tuple[tuple[int, int], ...] = CAP_SIZES) -> str:
    """A Markdown table of decision time p50/p99 (µs) at the cap per (engines, chats
    waiting)."""
    lines = [
        "| engines at the cap | chats waiting | decision p50 µs | decision p99 µs "
        "| CPU p50 µs | CPU p99 µs |",
        "|---|---|---|---|---|---|",
    ]
    for engines, waiting in sizes:
        times, cpu = cap_times(engines, waiting)
        lines.append(f"| {engines} | {waiting:,} | {_cells(times, cpu)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(sched_table())
    print()
    print(cap_table())
