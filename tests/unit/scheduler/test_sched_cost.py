"""What a decision costs does not grow with the batch queue: a ratio within one run.

The same interactive submit + dispatch is timed with 100 and with 20,000 batch jobs
queued behind engines whose budgets are full. Scanning the queue (as the scheduler
once did on every event) makes the second 100 times the first; indexed, they are
about equal. The bar (4x) leaves room for a loaded machine.
"""

from __future__ import annotations

import time

from proxy.scheduler import TrafficClass

from .helpers import engine, job, make

B = TrafficClass.BATCH
I = TrafficClass.INTERACTIVE  # noqa: E741 - read as a class name


def _median_decision_s(queued: int, engines: int = 16, repeats: int = 200) -> float:
    s, clock = make(*(engine(f"e{i}") for i in range(engines)))
    for _ in range(queued):
        s.submit(job(B, 1000, at=clock.now()))
    s.dispatch()
    assert len(s.queues[B]) >= queued - engines * 8  # most stay queued: budgets full
    times = []
    for _ in range(repeats):
        chat = job(I, 100, at=clock.now())
        start = time.perf_counter()
        s.submit(chat)
        s.dispatch()
        times.append(time.perf_counter() - start)
        s.on_finished(chat.id)
    return sorted(times)[len(times) // 2]


def test_decision_time_does_not_grow_with_the_batch_queue() -> None:
    small = min(_median_decision_s(100) for _ in range(2))
    large = min(_median_decision_s(20_000) for _ in range(2))
    assert large < 4 * small, (small, large)


def _median_decision_at_cap_s(queued: int, engines: int = 16, repeats: int = 200) -> float:
    """A chat submitted and a dispatch while every engine is at its cap, with
    ``queued`` chats already waiting (held for the cap)."""
    s, clock = make(*(engine(f"e{i}", max_inflight=2) for i in range(engines)))
    for _ in range(engines * 2 + queued):
        s.submit(job(I, 100, at=clock.now()))
    s.dispatch()
    assert len(s.queues[I]) == queued
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        s.submit(job(I, 100, at=clock.now()))
        s.dispatch()
        times.append(time.perf_counter() - start)
    assert all(j.held is not None for j in s.queues[I])
    return sorted(times)[len(times) // 2]


def test_decision_time_at_the_cap_does_not_grow_with_the_chats_waiting() -> None:
    """Every chat once went through the whole interactive queue on each decision:
    10,000 chats waiting made a decision 100 times one with 100."""
    small = min(_median_decision_at_cap_s(100) for _ in range(2))
    large = min(_median_decision_at_cap_s(10_000) for _ in range(2))
    assert large < 4 * small, (small, large)
