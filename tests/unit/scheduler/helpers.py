"""Builders and invariant checks shared by the tests of the proxy's scheduler."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from proxy.clock import VirtualClock
from proxy.config import BudgetConfig, EngineConfig
from proxy.scheduler import (
    EngineState,
    HeldReason,
    Job,
    Phase,
    Scheduler,
    SchedulerSettings,
    TrafficClass,
    Turn,
)

I = TrafficClass.INTERACTIVE  # noqa: E741 - read as a class name in the tables below
B = TrafficClass.BATCH

_ids = itertools.count()


def engine(name: str, *models: str, **overrides: Any) -> EngineConfig:
    """An engine serving ``models`` (default ``"m"``); ``budget=`` takes BudgetConfig
    or a dict of its fields."""
    budget = overrides.pop("budget", {})
    if isinstance(budget, dict):
        budget = BudgetConfig(**budget)
    return EngineConfig(name=name, models=frozenset(models or ("m",)), budget=budget, **overrides)


def make(
    *engines: EngineConfig, clock: VirtualClock | None = None, **settings: Any
) -> tuple[Scheduler, VirtualClock]:
    clock = clock or VirtualClock()
    return Scheduler(list(engines), clock, SchedulerSettings(**settings)), clock


def job(
    cls: TrafficClass,
    tokens: int,
    *,
    id: str | None = None,
    model: str = "m",
    at: float = 0.0,
    affinity: str | None = None,
) -> Job:
    return Job(
        id=id or f"{cls.value}-{next(_ids)}",
        cls=cls,
        model=model,
        prompt_tokens=tokens,
        arrival=at,
        affinity=affinity,
    )


def submit(s: Scheduler, cls: TrafficClass, tokens: int, **kw: Any) -> Job:
    """Submit a job arriving now."""
    j = job(cls, tokens, at=s.clock.now(), **kw)
    s.submit(j)
    return j


def sent(s: Scheduler) -> dict[str, str]:
    """Dispatch now; job id -> engine."""
    return {d.job.id: d.engine for d in s.dispatch()}


def assert_held_until(
    s: Scheduler, j: Job, reason: HeldReason, release: Callable[[], object], engine: str
) -> None:
    """``j`` goes nowhere, held for ``reason``, until ``release()``; then it goes to
    ``engine``."""
    assert sent(s) == {}
    assert j.held is reason
    release()
    assert sent(s) == {j.id: engine}


def candidates(s: Scheduler, j: Job) -> list[EngineState]:
    return [e for e in s.engines.values() if e.serves(j.model) and e.name not in j.excluded]


def queued_for(s: Scheduler, e: EngineState, cls: TrafficClass) -> list[Job]:
    return [j for j in s.queues[cls] if e.serves(j.model) and e.name not in j.excluded]


def check_accounting(s: Scheduler, seen: Sequence[Job] = ()) -> None:
    """Every known job is in exactly one place; forgotten ones are nowhere."""
    places: dict[int, list[str]] = {}
    for cls, queue in s.queues.items():
        for j in queue:
            assert j.cls is cls
            places.setdefault(id(j), []).append(f"queue:{cls}")
    for e in s.engines.values():
        for key, j in e.inflight.items():
            assert key == j.id
            places.setdefault(id(j), []).append(f"engine:{e.name}")
    for key, j in s.jobs.items():
        assert key == j.id
        where = places.get(id(j), [])
        assert len(where) == 1, (j.id, where)
        if j.phase is Phase.QUEUED:
            assert where == [f"queue:{j.cls}"] and j.engine is None
        else:
            assert j.phase in (Phase.PREFILL, Phase.DECODE), j
            assert where == [f"engine:{j.engine}"]
            assert j.engine not in j.excluded
    known = {id(j) for j in s.jobs.values()}
    assert set(places) <= known, "a queue or engine holds a job the scheduler forgot"
    for j in seen:
        if j.id not in s.jobs or s.jobs[j.id] is not j:
            assert j.phase is Phase.DONE and id(j) not in places, j


_VALID_REASONS: dict[Turn, set[HeldReason | None]] = {
    Turn.IDLE: {None},
    Turn.INTERACTIVE: {None, HeldReason.INTERACTIVE_WAITING},
    Turn.BATCH: {None, HeldReason.PREFILL_BUDGET, HeldReason.CONCURRENCY_CAP},
    Turn.SATURATED: {
        None,
        HeldReason.CONCURRENCY_CAP,
        HeldReason.KV_HEADROOM,
        HeldReason.ENGINE_UNHEALTHY,
    },
}


def check_turns(s: Scheduler) -> None:
    """Each engine's turn and held reason agree with its state (core.py, types.py):
    the held reason is exactly why its first batch job would be refused now, and the
    turn names the same rule."""
    for e in s.engines.values():
        head = next((j for j in s.queues[B] if e.eligible(j)), None)
        assert e.held_reason in _VALID_REASONS[e.turn], (e.name, e.turn, e.held_reason)
        assert e.held_reason is (None if head is None else e.batch_refusal(head))
        at_cap = len(e.inflight) >= e.settings.max_inflight
        if not e.up or at_cap:
            assert e.turn is Turn.SATURATED
        elif e.holds_for_interactive(head):
            assert e.turn is Turn.INTERACTIVE
            assert e.held_reason is (HeldReason.INTERACTIVE_WAITING if head else None)
        elif head is None:
            expected = Turn.BATCH if e.count(B) else Turn.IDLE
            assert e.turn is expected, (e.name, e.turn)
        else:
            saturated = e.held_reason is HeldReason.KV_HEADROOM
            assert e.turn is (Turn.SATURATED if saturated else Turn.BATCH), (e.name, e.turn)
        if not e.up:
            assert e.held_reason is (HeldReason.ENGINE_UNHEALTHY if head else None)
        elif at_cap:
            assert e.held_reason is (HeldReason.CONCURRENCY_CAP if head else None)


def check_held_jobs(s: Scheduler) -> None:
    """Right after a dispatch, the first batch job still queued carries the reason its
    first engine's turn names (the decision log and the turn agree)."""
    head = next(iter(s.queues[B]), None)
    engines = [e for e in s.engines.values() if head is not None and e.eligible(head)]
    if head is not None and engines:
        assert head.held is engines[0].held_reason, (head, engines[0].held_reason)


def check_clock(s: Scheduler, start: float, exact: bool) -> None:
    """Turn time never exceeds elapsed time (equals it right after an event when
    ``exact``); held time fits inside the non-idle time."""
    elapsed = s.clock.now() - start
    for e in s.engines.values():
        total = sum(e.turn_seconds.values())
        held = sum(e.held_seconds.values())
        assert all(v >= 0 for v in e.turn_seconds.values())
        assert total <= elapsed + 1e-6
        if exact:
            assert abs(total - elapsed) <= 1e-6, (e.name, total, elapsed)
        assert held <= total - e.turn_seconds[Turn.IDLE] + 1e-6
