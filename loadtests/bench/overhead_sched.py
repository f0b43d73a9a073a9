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

The rows marked ``(pump)`` (:data:`EVENTS`) time an event as
:meth:`proxy.admission.Admission.pump` handles it: the scheduler is told of it, then
``dispatch()`` and ``aborts_due()`` are called, and the clock moves 1 ms between events
(chats pass their hold timeout and budget loops run, as in the proxy). ``chat``: a chat
is submitted (it finishes after the timing); ``batch done``: the batch job in flight
longest finishes, and the dispatch sends the next queued one in its place.

At the cap (:func:`cap_table`): every engine (``max_inflight`` 4) is full of chats
and ``waiting`` more chats are queued, held for the cap; each repeat submits one
more chat and calls ``dispatch()``, timed the same way. This is the proxy under
more chat than its engines take, where each event once walked every waiting chat.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

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
EVENTS = (
    ("chat", 4, 10000),
    ("chat", 64, 10000),
    ("batch done", 4, 10000),
    ("batch done", 64, 10000),
)
STEP_S = 0.001  # the clock between two events of the (pump) rows

Times = tuple[list[float], list[float]]


def _timed(repeats: int, decide: Callable[[int], object], after: Callable[[int], object]) -> Times:
    """Seconds (wall, then CPU) of ``decide(i)`` for each ``i`` in ``range(repeats)``,
    sorted; ``after(i)`` runs untimed after each."""
    times, cpu = [], []
    for i in range(repeats):
        start, start_cpu = time.perf_counter(), time.thread_time()
        decide(i)
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
        after(i)
    return sorted(times), sorted(cpu)


def _scheduler(
    engines: int, max_inflight: int = EngineConfig.max_inflight
) -> tuple[Scheduler, VirtualClock]:
    clock = VirtualClock()
    models = frozenset({"m"})
    configs = [
        EngineConfig(name=f"e{i}", models=models, max_inflight=max_inflight) for i in range(engines)
    ]
    return Scheduler(configs, clock), clock


def _job(jid: str, cls: TrafficClass, tokens: int, clock: VirtualClock) -> Job:
    return Job(id=jid, cls=cls, model="m", prompt_tokens=tokens, arrival=clock.now())


def _chats(clock: VirtualClock, n: int, prefix: str = "i") -> list[Job]:
    """``n`` chats of 100 prompt tokens, made before the timing."""
    return [_job(f"{prefix}{i}", TrafficClass.INTERACTIVE, 100, clock) for i in range(n)]


def _with_batch_queued(engines: int, queued: int) -> tuple[Scheduler, VirtualClock, list[str]]:
    """A scheduler given ``queued`` batch jobs and a first dispatch; the ids sent."""
    scheduler, clock = _scheduler(engines)
    for i in range(queued):
        scheduler.submit(_job(f"b{i}", TrafficClass.BATCH, 1000, clock))
    return scheduler, clock, [d.job.id for d in scheduler.dispatch()]


def decision_times(
    engines: int, queued: int, repeats: int = 1000
) -> tuple[list[float], int, list[float]]:
    """Seconds per interactive submit + dispatch, sorted; the batch jobs still queued;
    and the CPU seconds of each, sorted."""
    scheduler, clock, _ = _with_batch_queued(engines, queued)
    waiting = len(scheduler.queues[TrafficClass.BATCH])
    chats = _chats(clock, repeats)

    def decide(i: int) -> None:
        scheduler.submit(chats[i])
        scheduler.dispatch()

    times, cpu = _timed(repeats, decide, lambda i: scheduler.on_finished(chats[i].id))
    return times, waiting, cpu


def event_times(
    event: str, engines: int, queued: int, repeats: int = 1000
) -> tuple[list[float], int, list[float]]:
    """Seconds per ``event`` (``chat`` or ``batch done``) with its ``dispatch()`` and
    ``aborts_due()``, the clock :data:`STEP_S` on at each, sorted; the batch jobs
    still queued before the first; and the CPU seconds of each, sorted."""
    scheduler, clock, sent = _with_batch_queued(engines, queued)
    waiting = len(scheduler.queues[TrafficClass.BATCH])
    flying = deque(sent)
    chats = _chats(clock, 1)  # the next made at each step, arriving then

    def chat(i: int) -> None:
        scheduler.submit(chats[i])
        scheduler.dispatch()
        scheduler.aborts_due()

    def batch_done(i: int) -> None:
        scheduler.on_finished(flying.popleft())
        flying.extend(d.job.id for d in scheduler.dispatch())
        scheduler.aborts_due()

    def after(i: int) -> None:
        if event == "chat":
            scheduler.on_finished(chats[i].id)
        clock.advance(STEP_S)
        chats.append(_job(f"i{i + 1}", TrafficClass.INTERACTIVE, 100, clock))

    times, cpu = _timed(repeats, chat if event == "chat" else batch_done, after)
    return times, waiting, cpu


def sched_table(
    sizes: tuple[tuple[int, int], ...] = SIZES,
    events: tuple[tuple[str, int, int], ...] = EVENTS,
) -> str:
    """A Markdown table of decision time p50/p99 (µs) per (engines, queued jobs), then
    per (pump) event."""
    lines = [
        "| event | engines | batch jobs submitted | still queued | decision p50 µs "
        "| decision p99 µs | CPU p50 µs | CPU p99 µs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = [("chat", *size, decision_times(*size)) for size in sizes]
    rows += [(f"{e} (pump)", n, q, event_times(e, n, q)) for e, n, q in events]
    for event, engines, queued, (times, waiting, cpu) in rows:
        cells = _cells(times, cpu)
        lines.append(f"| {event} | {engines} | {queued:,} | {waiting:,} | {cells} |")
    return "\n".join(lines)


def _cells(times: list[float], cpu: list[float]) -> str:
    """p50 and p99 (µs) of the sorted wall and CPU times, as table cells."""
    picks = [s[int(q * len(s))] for s in (times, cpu) for q in (0.5, 0.99)]
    return " | ".join(f"{x * 1e6:,.0f}" for x in picks)


CAP_SIZES = ((4, 1000), (64, 1000), (64, 10000))


def cap_times(engines: int, waiting: int, repeats: int = 1000) -> Times:
    """Seconds per chat submit + dispatch with every engine at its cap and
    ``waiting`` chats queued, sorted; and the CPU seconds of each, sorted."""
    scheduler, clock = _scheduler(engines, max_inflight=4)
    for i in range(engines * 4 + waiting):
        scheduler.submit(_job(f"c{i}", TrafficClass.INTERACTIVE, 100, clock))
    scheduler.dispatch()
    chats = _chats(clock, repeats, "x")

    def decide(i: int) -> None:
        scheduler.submit(chats[i])
        scheduler.dispatch()

    return _timed(repeats, decide, lambda i: None)


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
