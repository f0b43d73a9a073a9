"""Properties of the scheduler over random interleavings of events.

Random engines (one to three, serving one or both of two models, small concurrency
caps, random budgets and KV watermarks) and random sequences of arrivals of both
classes, dispatches, first tokens, token gaps, finishes, failures, cancels, health
changes, load scrapes and clock advances. After every event the
scheduler's state is checked against the rules in ``proxy/scheduler/core.py``;
every dispatch is checked against the state just before it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import Phase as HPhase
from hypothesis import strategies as st

from proxy.clock import VirtualClock
from proxy.config import BudgetConfig, EngineConfig
from proxy.scheduler import (
    Dispatch,
    EngineLoad,
    HeldReason,
    HoldRules,
    Job,
    Phase,
    Scheduler,
    SchedulerSettings,
    TrafficClass,
    UnknownModel,
)

from .helpers import (
    B,
    I,
    candidates,
    check_accounting,
    check_clock,
    check_held_jobs,
    check_turns,
    job,
    queued_for,
)

Op = tuple[Any, ...]  # an event: its kind, then its parameters
# the hold without its waivers (no starvation credit, no timeout): the dispatch checks
# below assert the budget and the hold exactly; the drawn rules test the agreement
STRICT = HoldRules(batch_min_share=0.0, hold_timeout_s=float("inf"))
HOLDS = st.sampled_from([STRICT, HoldRules(), HoldRules(batch_min_share=0.3, hold_timeout_s=0.5)])
MODELS = ("m1", "m2")
AFFINITIES = (None, None, "c0", "c1", "c2")
PROPS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    # no explain phase: on these long event lists it costs minutes for a comment
    phases=[HPhase.explicit, HPhase.reuse, HPhase.generate, HPhase.target, HPhase.shrink],
)
# a run that passes takes seconds; one that fails spends minutes shrinking its example
SHRINK_TIME = pytest.mark.timeout(300)


@st.composite
def budgets(draw: st.DrawFn) -> BudgetConfig:
    lo = draw(st.sampled_from([1, 100, 500, 2000]))
    hi = draw(st.sampled_from([lo, 2 * lo, 4000, 20_000]))
    return BudgetConfig(
        initial_tokens=draw(st.sampled_from([lo, (lo + hi) // 2, hi])),
        min_tokens=lo,
        max_tokens=hi,
        ttft_target_s=draw(st.sampled_from([0.1, 0.5, 2.0, 10.0])),
        gap_target_s=draw(st.sampled_from([0.05, 0.2, 1.0])),
        aim=draw(st.sampled_from([0.5, 0.8, 1.0])),
        window_s=draw(st.sampled_from([5.0, 30.0])),
        interval_s=draw(st.sampled_from([0.5, 1.0, 3.0])),
        min_samples=draw(st.integers(1, 4)),
        decrease=draw(st.sampled_from([0.3, 0.5, 0.9])),
        increase_tokens=draw(st.integers(1, 2000)),
    )


@st.composite
def engine_sets(draw: st.DrawFn) -> list[EngineConfig]:
    n = draw(st.integers(1, 3))
    out = []
    for k in range(n):
        models = draw(st.sets(st.sampled_from(MODELS), min_size=1))
        out.append(
            EngineConfig(
                name=f"e{k}",
                models=frozenset(models),
                max_inflight=draw(st.sampled_from([1, 3, 8])),
                batch_max_inflight=draw(st.sampled_from([1, 2, 8])),
                kv_high_watermark=draw(st.sampled_from([0.3, 0.8, 1.0])),
                budget=draw(budgets()),
            )
        )
    return out


FLYING = (Phase.PREFILL, Phase.DECODE)
KINDS = (
    ["tick"]  # first: the zero an example shrinks towards is an idle tick
    + ["submit"] * 6
    + ["dispatch"] * 4
    + ["first"] * 3
    + ["finish"] * 3
    + ["advance"] * 3
    + ["fail"] * 2
    + ["gap", "cancel", "up", "load"]
)
ADVANCES = (0.0, 0.05, 0.3, 1.0, 2.5)
GAPS = (0.0, 0.01, 0.2, 1.5)
LOADS = (0.0, 0.0, 0.2, 0.5, 0.95)
SUBMIT_MODELS = (*MODELS, *MODELS, *MODELS, "nope")


class _Digits:
    """Reads small choices off one integer, so that an event costs one draw (cheap to
    generate and to shrink: smaller integers are simpler events)."""

    def __init__(self, x: int) -> None:
        self.x = x

    def take(self, n: int) -> int:
        self.x, r = divmod(self.x, n)
        return r


def decode(x: int, batch_share: float) -> Op:
    d = _Digits(x)
    kind = KINDS[d.take(len(KINDS))]
    target = d.take(1024)  # picks a job among the candidates for the event
    if kind == "submit":
        cls = B if d.take(10) < batch_share * 10 else I
        model = SUBMIT_MODELS[d.take(len(SUBMIT_MODELS))]
        tokens = 1 + (d.take(600) if d.take(2) == 0 else d.take(25_000))
        return (kind, cls, model, tokens, AFFINITIES[d.take(len(AFFINITIES))])
    params: dict[str, Op] = {
        "first": (target,),
        "finish": (target,),
        "cancel": (target,),
        "advance": (ADVANCES[d.take(len(ADVANCES))],),
        "gap": (target, GAPS[d.take(len(GAPS))]),
        "fail": (target, d.take(2) == 1),
        "up": (d.take(3), d.take(3) > 0),
        "load": (d.take(3), LOADS[d.take(len(LOADS))]),
    }
    return (kind, *params.get(kind, ()))


def readable(ops: list[Op]) -> str:
    """The events one per line, runs of one event folded, for a failure report."""
    lines: list[str] = []
    for key, group in itertools.groupby(ops):
        n = len(list(group))
        lines.append(f"{key}" + (f" x{n}" if n > 1 else ""))
    return "\n".join(lines)


def op_lists(min_size: int, max_size: int) -> st.SearchStrategy[list[Op]]:
    """Event sequences; each example has its own mix of classes among arrivals."""
    shares = st.sampled_from([0.1, 0.5, 0.9])
    # bytes rather than integers: hypothesis draws them near uniformly, and integers
    # lean towards small values, which would read as the same few events
    code = st.binary(min_size=6, max_size=6).map(lambda b: int.from_bytes(b, "big"))
    codes = st.lists(code, min_size=min_size, max_size=max_size)
    return st.tuples(shares, codes).map(lambda sc: [decode(x, sc[0]) for x in sc[1]])


@dataclass
class Run:
    """A scheduler under test and what the test saw of it."""

    engines: list[EngineConfig]
    clock: VirtualClock = field(default_factory=VirtualClock)
    seen: list[Job] = field(default_factory=list)
    batch_sent: list[str] = field(default_factory=list)
    affinity: dict[str, str] = field(default_factory=dict)  # conversation -> last engine
    ids: Iterator[int] = field(default_factory=itertools.count)
    hold: HoldRules = STRICT

    def __post_init__(self) -> None:
        settings = SchedulerSettings(decision_log_size=10**6, hold=self.hold)
        self.s = Scheduler(self.engines, self.clock, settings)
        self.start = self.clock.now()

    def pick(self, k: int, phases: tuple[Phase, ...] | None = None) -> Job | None:
        pool = [j for j in self.seen if phases is None or j.phase in phases]
        return pool[k % len(pool)] if pool else None

    def apply(self, op: Op) -> bool:
        """Apply one event; returns whether the scheduler took it as an event (and
        so brought its time accounting up to now)."""
        s, kind = self.s, op[0]
        if kind == "submit":
            return self.submit(*op[1:])
        if kind == "dispatch":
            self.dispatch()
        elif kind == "first" and (j := self.pick(op[1], (Phase.PREFILL,))):
            s.on_first_token(j.id)
            assert j.phase is Phase.DECODE and j.first_token_at == self.clock.now()
        elif kind == "finish" and (j := self.pick(op[1], FLYING)):
            assert s.on_finished(j.id) is j
        elif kind == "fail" and (j := self.pick(op[1], FLYING if op[1] % 4 else None)):
            return self.fail(j, op[2])
        elif kind == "cancel" and (j := self.pick(op[1])):
            known = j.id in s.jobs
            assert (s.cancel(j.id) is j) == known
        elif kind == "up" and op[1] < len(self.engines):
            s.set_engine_up(self.engines[op[1]].name, op[2])
        elif kind == "load" and op[1] < len(self.engines):
            s.observe_load(self.engines[op[1]].name, EngineLoad(kv_usage=op[2]))
        elif kind == "tick":
            s.tick()
        else:
            self.quiet(op)
            return False
        return True

    def quiet(self, op: Op) -> None:
        """Events that do not move the scheduler's accounting."""
        kind = op[0]
        if kind == "gap" and (j := self.pick(op[1])):
            self.s.on_token_gap(j.id, op[2])
        elif kind == "advance":
            self.clock.advance(op[1])

    def submit(self, cls: TrafficClass, model: str, tokens: int, affinity: str | None) -> bool:
        jid = f"{cls.value}-{next(self.ids)}"
        j = job(cls, tokens, id=jid, model=model, at=self.clock.now(), affinity=affinity)
        if not any(model in e.models for e in self.engines):
            with pytest.raises(UnknownModel):
                self.s.submit(j)
            return False
        self.s.submit(j)
        self.seen.append(j)
        return True

    def fail(self, j: Job, retry: bool) -> bool:
        """on_failed, for a job in flight or not (a second report of one failure)."""
        s = self.s
        in_flight = j.id in s.jobs and j.phase in (Phase.PREFILL, Phase.DECODE)
        engine = j.engine
        others = in_flight and any(
            e.up and e.name != engine for e in candidates(s, j) if e.name not in j.excluded
        )
        requeued = s.on_failed(j.id, retry=retry)
        assert requeued == (in_flight and retry and others), (j, requeued)
        if requeued:
            assert s.queues[j.cls][0] is j and engine in j.excluded
        elif in_flight:
            assert j.id not in s.jobs and j.phase is Phase.DONE
        return in_flight

    def dispatch(self) -> list[Dispatch]:
        s = self.s
        before = {
            name: (e.prefill_tokens(), e.budget.tokens, len(e.inflight), e.count(B))
            for name, e in s.engines.items()
        }
        queued = {id(j) for q in s.queues.values() for j in q}
        excluded = {j.id: set(j.excluded) for q in s.queues.values() for j in q}
        log_from = len(s.log)
        out = s.dispatch()
        if self.hold == STRICT:  # the waivers of HoldRules are tested on their own
            check_dispatches(s, out, before, queued, excluded)
        check_routing(s, out, before, excluded, self.affinity)
        admitted = [d for d in s.log if d.admitted][-len(out) :] if out else []
        assert [(d.job_id, d.engine) for d in admitted] == [(d.job.id, d.engine) for d in out]
        assert all(d.budget == before[d.engine][1] for d in list(s.log)[log_from:])
        self.batch_sent += [d.job.id for d in out if d.job.cls is B]
        check_work_conserving(s)
        check_held_jobs(s)
        return out

    def check(self, exact_time: bool) -> None:
        check_accounting(self.s, self.seen)
        check_turns(self.s)
        check_clock(self.s, self.start, exact_time)
        for e in self.s.engines.values():
            b = e.budget.settings
            assert b.min_tokens <= e.budget.tokens <= b.max_tokens


def check_dispatches(
    s: Scheduler,
    out: list[Dispatch],
    before: dict[str, tuple[int, int, int, int]],
    queued: set[int],
    excluded: dict[str, set[str]],
) -> None:
    """Each dispatch against the engine's state just before it, in order."""
    prefill = {n: b[0] for n, b in before.items()}
    inflight = {n: b[2] for n, b in before.items()}
    batch = {n: b[3] for n, b in before.items()}
    now = s.clock.now()
    assert len({id(d.job) for d in out}) == len(out)
    classes = [d.job.cls for d in out]
    assert classes == sorted(classes, key=lambda c: c is B), "interactive goes first"
    for d in out:
        j, e = d.job, s.engines[d.engine]
        assert id(j) in queued and j.engine == d.engine and j.dispatched_at == now
        assert e.up and e.serves(j.model) and d.engine not in excluded[j.id]
        assert inflight[d.engine] < e.settings.max_inflight
        if j.cls is B:
            assert batch[d.engine] < e.settings.batch_max_inflight
            assert e.load.kv_usage < e.settings.kv_high_watermark
            # the budget, or the single-request rule: nothing else in prefill there
            p = prefill[d.engine]
            assert p == 0 or p + j.prompt_tokens <= before[d.engine][1], (p, j, before)
            if p == 0 and j.prompt_tokens > before[d.engine][1]:
                event("single-request rule")
            elif p:
                event("batch beside other prefill")
            # no interactive job queued for the engine or in prefill on it
            assert not queued_for(s, e, I)
            assert not e.chats_in_prefill()
            batch[d.engine] += 1
        prefill[d.engine] += j.prompt_tokens
        inflight[d.engine] += 1


def check_routing(
    s: Scheduler,
    out: list[Dispatch],
    before: dict[str, tuple[int, int, int, int]],
    excluded: dict[str, set[str]],
    affinity: dict[str, str],
) -> None:
    """Interactive jobs go to the least predicted wait (prompt tokens in prefill plus
    their own), or to their conversation's engine when that is within the slack."""
    prefill = {n: b[0] for n, b in before.items()}
    inflight = {n: b[2] for n, b in before.items()}
    slack = s.settings.affinity_slack_tokens
    for d in out:
        j = d.job
        if j.cls is I:
            ready = [
                e.name
                for e in s.engines.values()
                if e.serves(j.model)
                and e.name not in excluded[j.id]
                and e.up
                and inflight[e.name] < e.settings.max_inflight
            ]
            best = min(prefill[n] for n in ready) + j.prompt_tokens
            preferred = affinity.get(j.affinity) if j.affinity else None
            if preferred in ready and prefill[preferred] + j.prompt_tokens <= best + slack:
                assert d.engine == preferred, (j, preferred, prefill)
                event("routed by affinity")
            else:
                assert prefill[d.engine] + j.prompt_tokens == best, (j, prefill)
                # ties go to fewer jobs in flight, then the name (EngineState.rank)
                least = min(ready, key=lambda n: (prefill[n], inflight[n], n))
                assert d.engine == least, (j, least, prefill, inflight)
        if j.affinity:
            affinity[j.affinity] = d.engine
        prefill[d.engine] += j.prompt_tokens
        inflight[d.engine] += 1


def check_work_conserving(s: Scheduler) -> None:
    """After a dispatch, interactive jobs wait only where every engine for them is at
    its cap or down, and batch waits on an engine only for a stated reason (or on a
    budget that grew after the round's decisions)."""
    for j in s.queues[I]:
        engines = candidates(s, j)
        assert all(not e.can_take_interactive() for e in engines), j
        # held for the reason its own candidates give, even where the pass held the
        # chats of a model together and skipped those held already
        up = any(e.up for e in engines)
        assert j.held is (HeldReason.CONCURRENCY_CAP if up else HeldReason.ENGINE_UNHEALTHY), j
    for e in s.engines.values():
        h = e.budget.history
        grew_now = len(h) > 1 and h[-1][0] == s.clock.now() and h[-1][1] > h[-2][1]
        if queued_for(s, e, B):
            # held for a stated reason, or admissible on a budget that grew just now
            assert e.held_reason is not None or grew_now, e.name
            if e.chats_in_prefill() and not queued_for(s, e, I):
                event("batch held for interactive prefill")


def check_log(s: Scheduler) -> None:
    """Admissions carry no reason; a job's hold is logged again only with a new
    reason (or after it was admitted and came back)."""
    last: dict[str, HeldReason | None] = {}
    for d in s.log:
        assert s.engines[d.engine].settings.budget.min_tokens <= d.budget
        if d.admitted:
            assert d.reason is None
            last[d.job_id] = None
        else:
            assert d.reason is not None and last.get(d.job_id) is not d.reason, d
            last[d.job_id] = d.reason


def describe(run: Run) -> None:
    """Label the example, so that ``--hypothesis-show-statistics`` shows coverage."""
    for reason in {d.reason for d in run.s.log if d.reason is not None}:
        event(f"held: {reason}")
    for turn in {t for e in run.s.engines.values() for t, v in e.turn_seconds.items() if v}:
        event(f"turn: {turn}")
    event(f"batch dispatched: {min(len(run.batch_sent), 5)}+")
    for e in run.s.engines.values():
        steps = [b - a for (_, a), (_, b) in itertools.pairwise(e.budget.history)]
        if any(d < 0 for d in steps):
            event("budget cut")
        if any(d > 0 for d in steps):
            event("budget grown")
    if any(j.attempts for j in run.seen):
        event("requeued after failure")


def finish_everything(run: Run) -> None:
    for e in run.s.engines.values():
        for j in list(e.inflight.values()):
            run.s.on_first_token(j.id)
    run.clock.advance(1.0)
    for e in run.s.engines.values():
        for j in list(e.inflight.values()):
            run.s.on_finished(j.id)


@SHRINK_TIME
@PROPS
@given(engines=engine_sets(), ops=op_lists(40, 150), hold=HOLDS)
def test_every_event_keeps_the_rules(
    engines: list[EngineConfig], ops: list[Op], hold: HoldRules
) -> None:
    note(readable(ops))
    run = Run(engines, hold=hold)
    for op in ops:
        run.check(exact_time=run.apply(op))
    run.s.tick()
    run.check(exact_time=True)
    check_log(run.s)
    describe(run)
    if len(engines) == 1:
        # one engine (so no retries): batch jobs are dispatched in arrival order
        order = [j.id for j in run.seen if j.cls is B]
        assert run.batch_sent == [i for i in order if i in set(run.batch_sent)]


@SHRINK_TIME
@PROPS
@given(engines=engine_sets(), ops=op_lists(10, 100))
def test_batch_drains_once_interactive_load_stops(
    engines: list[EngineConfig],
    ops: list[Op],
) -> None:
    """Whatever happened before, once interactive arrivals stop, engines are healthy
    and in-flight work finishes, each dispatch/finish cycle admits batch work (the
    single-request rule takes prompts larger than the budget) until none is left."""
    note(readable(ops))
    run = Run(engines)
    for op in ops:
        run.apply(op)
    for e in engines:
        run.s.set_engine_up(e.name, True)
        run.s.observe_load(e.name, EngineLoad())
    waiting = [j for j in run.seen if j.id in run.s.jobs and j.cls is B]
    for _ in range(len(run.s.jobs) + 1):
        finish_everything(run)
        if not run.s.jobs:
            break
        assert run.dispatch(), "a cycle with nothing in flight admitted nothing"
        run.check(exact_time=True)
    assert not run.s.jobs
    assert all(j.phase is Phase.DONE and j.dispatched_at is not None for j in waiting)


@SHRINK_TIME
@PROPS
@given(
    budget=st.integers(100, 5000),
    prompts=st.lists(st.integers(1, 12_000), min_size=1, max_size=30),
    small=st.integers(1, 400),
    cycles_in_flight=st.integers(1, 3),
)
def test_batch_is_first_come_first_served_on_an_engine(
    budget: int, prompts: list[int], small: int, cycles_in_flight: int
) -> None:
    """Small batch jobs keep arriving and something is always in prefill; a large job
    (even one over the budget) is still dispatched, and never overtaken."""
    e = EngineConfig(
        name="e",
        models=frozenset({"m"}),
        max_inflight=64,
        batch_max_inflight=64,
        budget=BudgetConfig(initial_tokens=budget, min_tokens=budget, max_tokens=budget),
    )
    run = Run([e])
    for p in prompts:
        run.submit(B, "m", p, None)
    order = [j.id for j in run.seen]
    for _ in range(5 * len(prompts) + 5):
        run.dispatch()
        run.check(exact_time=True)
        # finish the oldest job in flight, and a small one arrives behind everyone
        flying = sorted(run.s.engines["e"].inflight.values(), key=lambda j: j.dispatched_at or 0)
        for j in flying[:cycles_in_flight]:
            run.s.on_first_token(j.id)
            run.s.on_finished(j.id)
        run.clock.advance(0.5)
        run.submit(B, "m", small, None)
        if all(i in run.batch_sent for i in order):
            break
    assert run.batch_sent[: len(order)] == order
