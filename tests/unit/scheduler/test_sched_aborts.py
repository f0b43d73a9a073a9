"""Aborting a batch job in prefill for a chat: the rule (when, which, how often) and
the scheduler's requeue (at the head, pinned to its engine, logged)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from proxy.config import EngineConfig
from proxy.scheduler import Abort, EngineState, HoldRules, Job, Phase, Scheduler
from proxy.scheduler.aborts import choose_abort, longest_waiting, may_abort, remaining_prefill

from .helpers import B, I, check_accounting, check_turns, engine, make, sent

pytestmark = pytest.mark.timeout(10)

AIM = 0.8 * 0.3  # the default budget's aim x TTFT target


def batch(
    id: str = "final", tokens: int = 400, *, prefill_s: float | None = 0.5, **kw: object
) -> Job:
    fields: dict[str, object] = {"abortable": True, "prefill_s": prefill_s, "pinned": "a"}
    fields |= kw
    return Job(id=id, cls=B, model="m", prompt_tokens=tokens, arrival=0.0, **fields)  # type: ignore[arg-type]


def chat(s: Scheduler, id: str = "chat", pinned: str | None = None) -> Job:
    j = Job(id=id, cls=I, model="m", prompt_tokens=50, arrival=s.clock.now(), pinned=pinned)
    s.submit(j)
    return j


def running(job: Job, *names: str, **settings: object) -> Scheduler:
    """A scheduler with engines ``names`` (default a), ``job`` submitted and sent to
    a at time 0."""
    engines = [engine(n) for n in names or ("a",)]
    s, _ = make(*engines, **settings)  # type: ignore[arg-type]
    s.submit(job)
    assert sent(s) == {job.id: "a"}
    return s


# -- the rule --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefill_s", "chat_at", "expected"),
    [
        # the chat comes at 0.1 s: it has waited 0 and the job's prefill has
        # 0.5 - 0.1 = 0.4 s left: 0.4 > 0.24, at risk
        (0.5, 0.1, (0.0, 0.4)),
        (0.2, 0.1, None),  # 0.1 s left: within the aim
        (0.33, 0.1, None),  # 0.23 s left: just within the aim
        (None, 0.1, None),  # the cost unknown: nothing left to count, not yet at risk
    ],
)
def test_a_chat_is_at_risk_when_its_wait_and_the_prefill_left_pass_the_aim(
    prefill_s: float | None, chat_at: float, expected: tuple[float, float] | None
) -> None:
    s = running(batch(prefill_s=prefill_s))
    s.clock.advance(chat_at)  # type: ignore[attr-defined]
    chat(s)
    assert sent(s) == {"chat": "a"}  # chat first: sent at once, behind the batch job
    due = s.aborts_due()
    if expected is None:
        assert due == []
        return
    assert due == [Abort("final", "a", "chat", *expected, AIM, number=1, limit=3)]


def test_the_sum_is_steady_until_the_job_overruns_its_estimate() -> None:
    s = running(batch(prefill_s=0.2))
    s.clock.advance(0.1)  # type: ignore[attr-defined]
    chat(s)
    sent(s)
    for at in (0.2, 0.33):  # waited 0.1 + left 0.0; waited 0.23 + left 0.0
        s.clock.advance_to(at)  # type: ignore[attr-defined]
        assert s.aborts_due() == []
    s.clock.advance_to(0.36)  # type: ignore[attr-defined]
    (abort,) = s.aborts_due()  # the job ran past its estimate, the chat past the aim
    assert abort.waited_s == pytest.approx(0.26) and abort.remaining_s == 0.0


def test_the_unknown_cost_fires_once_the_chat_itself_waited_past_the_aim() -> None:
    s = running(batch(prefill_s=None))
    chat(s)
    sent(s)
    s.clock.advance(AIM)  # type: ignore[attr-defined]
    assert s.aborts_due() == []
    s.clock.advance(0.01)  # type: ignore[attr-defined]
    (abort,) = s.aborts_due()
    assert abort.remaining_s == 0.0 and abort.waited_s == pytest.approx(AIM + 0.01)


@pytest.mark.parametrize(
    "why",
    ["not abortable", "interactive", "chat sent first", "decoding", "no chat", "other engine"],
)
def test_what_is_never_aborted(why: str) -> None:
    j = batch(abortable=why != "not abortable")
    if why == "interactive":
        j = Job(id="final", cls=I, model="m", prompt_tokens=400, arrival=0.0, abortable=True)
    names = ("a", "b") if why == "other engine" else ("a",)
    # batch may run beside a chat in prefill, so a chat can be sent before it
    s, clock = make(*(engine(n) for n in names), hold=HoldRules(interactive_hold=False))
    if why == "chat sent first":  # ahead of the batch job in the engine's queue
        chat(s, "early")
        sent(s)
        clock.advance(0.01)
    s.submit(j)
    sent(s)
    clock.advance(1.0)
    if why == "decoding":
        s.on_first_token("final")
    if why == "other engine":
        c = Job(id="chat", cls=I, model="m", prompt_tokens=50, arrival=0.0, pinned="b")
        s.submit(c)
        assert sent(s) == {"chat": "b"}
    elif why not in ("no chat", "chat sent first"):
        chat(s)
        sent(s)
    clock.advance(1.0)
    assert s.aborts_due() == []


def test_a_chat_queued_in_the_proxy_for_the_engine_counts() -> None:
    s, clock = make(engine("a", max_inflight=1))
    s.submit(batch())
    sent(s)
    chat(s)
    assert sent(s) == {}  # the engine is at its cap: the chat waits in the proxy
    clock.advance(0.1)
    (abort,) = s.aborts_due()
    assert abort.chat_id == "chat" and abort.remaining_s == pytest.approx(0.4)
    assert s.abort(abort)
    assert sent(s) == {"chat": "a"}  # the slot the batch job held goes to the chat


def test_of_several_the_one_with_the_most_prefill_left_goes_first() -> None:
    s, clock = make(engine("a"))
    for name, prefill in (("small", 0.3), ("big", 0.9), ("mid", 0.5)):
        s.submit(batch(name, 100, prefill_s=prefill))
    assert set(sent(s)) == {"small", "big", "mid"}
    chat(s)
    sent(s)
    engine_a = s.engines["a"]
    waiting = engine_a.chats_in_prefill()
    choice = choose_abort(engine_a, waiting, clock.now(), 3)
    assert choice is not None and choice.job_id == "big"
    assert s.aborts_due() == [choice]  # at most one per engine; the rule asked again after
    assert s.abort(choice)
    assert [a.job_id for a in s.aborts_due()] == ["mid"]


# -- the requeue -----------------------------------------------------------------


def test_an_aborted_job_goes_back_first_on_its_engine_and_runs_after_the_chat() -> None:
    s = running(batch())
    other = Job(id="later", cls=B, model="m", prompt_tokens=10, arrival=0.05)
    s.submit(other)
    s.clock.advance(0.1)  # type: ignore[attr-defined]
    chat(s)
    sent(s)
    (abort,) = s.aborts_due()
    assert s.abort(abort)
    final = s.jobs["final"]
    assert final.phase is Phase.QUEUED and final.aborts == 1 and final.engine is None
    assert next(iter(s.queues[B])) is final  # at the head, ahead of later batch work
    assert s.engines["a"].prefill_tokens(B) == 0  # its tokens left the engine
    check_accounting(s)
    check_turns(s)
    last = s.log[-1]
    assert (last.action, last.abort, last.job_id, last.engine) == ("abort", abort, "final", "a")
    assert not s.abort(abort)  # no longer in prefill: nothing to abort
    s.on_first_token("chat")
    assert sent(s)["final"] == "a"  # pinned: where its pieces are cached
    assert s.log[-1].action == "admit"


def test_a_whole_request_aborted_is_pinned_to_its_engine() -> None:
    s = running(batch(pinned=None), "a", "b")
    s.clock.advance(0.1)  # type: ignore[attr-defined]
    chat(s, pinned="a")
    sent(s)
    (abort,) = s.aborts_due()
    assert s.abort(abort)
    job = s.jobs["final"]
    assert job.pinned == "a" and job.excluded == {"b"}


def test_a_job_is_aborted_at_most_the_limit_then_runs_to_the_end() -> None:
    s = running(batch(), abort_limit=2)
    for round in range(3):
        s.clock.advance(0.1)  # type: ignore[attr-defined]
        chat(s, f"chat-{round}")
        sent(s)
        due = s.aborts_due()
        if round == 2:
            assert due == [] and not may_abort(s.jobs["final"], 2)
            break
        assert [a.number for a in due] == [round + 1]
        assert s.abort(due[0])
        s.on_first_token(f"chat-{round}")
        assert sent(s) == {"final": "a"}
    assert s.jobs["final"].aborts == 2
    assert [d.job_id for d in s.log if d.action == "abort"] == ["final", "final"]


def test_the_edge_saying_it_answers_ends_the_abortability() -> None:
    s = running(batch())
    s.on_answering("final")
    chat(s)
    sent(s)
    s.clock.advance(1.0)  # type: ignore[attr-defined]
    assert s.aborts_due() == []


def test_reads_change_nothing_and_the_same_events_give_the_same_aborts() -> None:
    def run() -> list[tuple[str, str, float, float]]:
        s = running(batch(prefill_s=0.6))
        for step in range(4):
            s.clock.advance(0.05)  # type: ignore[attr-defined]
            chat(s, f"c{step}")
            sent(s)
            before = ([(j.id, j.phase, j.aborts) for j in s.jobs.values()], list(s.log))
            due = s.aborts_due()
            assert s.aborts_due() == due  # a read: asked twice, the same answer
            assert ([(j.id, j.phase, j.aborts) for j in s.jobs.values()], list(s.log)) == before
            for abort in due:
                s.abort(abort)
            s.on_first_token(f"c{step}")
            sent(s)
        return [(d.action, d.job_id, d.time, d.abort.remaining_s if d.abort else -1) for d in s.log]

    first = run()
    assert first == run()
    assert sum(1 for d in first if d[0] == "abort") == 3  # the default limit


def test_remaining_prefill() -> None:
    j = batch(prefill_s=0.5)
    assert remaining_prefill(j, 1.0) == 0.0  # not sent
    j.dispatched_at = 1.0
    assert remaining_prefill(j, 1.2) == pytest.approx(0.3)
    assert remaining_prefill(j, 2.0) == 0.0


# -- random interleavings ----------------------------------------------------------

KINDS = ("batch", "batch", "chat", "dispatch", "dispatch", "first", "finish", "cancel")
KINDS += ("advance", "abort", "abort", "abort")
EVENTS = st.lists(
    st.tuples(st.sampled_from(KINDS), st.integers(0, 63), st.sampled_from([0.5, 0.1, 0.0])),
    min_size=30,
    max_size=100,
)


def check_abort(s: Scheduler, abort: Abort, now: float) -> None:
    """An abort names an abortable batch job in prefill on its engine, below the
    limit, with a chat waiting behind it past the aim."""
    job = s.jobs[abort.job_id]
    assert job.cls is B and job.abortable and job.phase is Phase.PREFILL
    assert job.engine == abort.engine and abort.number == job.aborts + 1 <= abort.limit
    assert abort.waited_s + abort.remaining_s > abort.aim_s
    chat = s.jobs[abort.chat_id]
    assert chat.cls is I and (chat.phase is Phase.QUEUED or chat.engine == abort.engine)
    if chat.phase is not Phase.QUEUED:  # in prefill behind the job, not ahead of it
        assert chat.phase is Phase.PREFILL and chat.dispatched_at is not None
        assert job.dispatched_at is not None and chat.dispatched_at >= job.dispatched_at
    assert abort.waited_s == pytest.approx(now - chat.arrival)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=EVENTS, engines=st.integers(1, 2), limit=st.integers(1, 3), hold=st.booleans())
@pytest.mark.timeout(120)
def test_aborts_over_random_events_lose_no_job_and_keep_the_limit(
    events: list[tuple[str, int, float]], engines: int, limit: int, hold: bool
) -> None:
    names = "ab"[:engines]
    rules = HoldRules(interactive_hold=hold)  # without: batch also goes beside chat prefill
    s, clock = make(*(engine(n, max_inflight=3) for n in names), abort_limit=limit, hold=rules)
    seen: list[Job] = []
    finished: list[str] = []
    for kind, k, x in events:
        live = [j for j in seen if j.id in s.jobs]
        pick = live[k % len(live)] if live else None
        if kind == "batch":
            j = batch(f"b{len(seen)}", 100 + k, prefill_s=x or None, pinned=None)
            j.abortable = k % 4 != 0
            s.submit(j)
            seen.append(j)
            s.dispatch()
        elif kind == "chat":  # sent at once, as the edge does
            seen.append(chat(s, f"c{len(seen)}"))
            s.dispatch()
        elif kind == "dispatch":
            s.dispatch()
        elif kind == "first" and pick is not None:
            s.on_first_token(pick.id)
        elif kind == "finish" and pick is not None and pick.phase is not Phase.QUEUED:
            assert s.on_finished(pick.id) is pick
            finished.append(pick.id)
        elif kind == "cancel" and pick is not None:
            s.cancel(pick.id)
        elif kind == "advance":
            clock.advance(x)
        elif kind == "abort":
            due = s.aborts_due()
            assert s.aborts_due() == due and len({a.engine for a in due}) == len(due)
            for abort in due:
                check_abort(s, abort, clock.now())
                assert s.abort(abort)
                assert s.jobs[abort.job_id].phase is Phase.QUEUED
        check_accounting(s, seen)
        check_turns(s)
        assert all(j.aborts <= limit for j in seen)
    assert len(finished) == len(set(finished))  # none ran to completion twice
    cut = [d for d in s.log if d.action == "abort"]
    event(f"aborts: {min(len(cut), 3)}+")
    event(f"most aborts of one job: {max((j.aborts for j in seen), default=0)}")
    assert all(d.abort is not None and d.abort.job_id == d.job_id for d in cut)
    for j in seen:
        assert sum(1 for d in cut if d.job_id == j.id) == j.aborts


# -- the queued chat the rule reads (one walk for every engine) ------------------


@given(
    chats=st.lists(
        st.tuples(
            st.sampled_from(["m", "n"]),
            st.integers(0, 5),  # arrival (ties broken by id)
            st.sampled_from([None, "a", "b", "c"]),  # excluded
            st.sampled_from([None, None, "a", "b"]),  # pinned
        ),
        max_size=12,
    ),
    draining=st.sampled_from([None, "a", "b", "c"]),
)
def test_longest_waiting_is_the_least_arrival_each_engine_may_take(
    chats: list[tuple[str, int, str | None, str | None]], draining: str | None
) -> None:
    engines = [
        EngineState(EngineConfig(name=n, models=frozenset(ms)), 0.0)
        for n, ms in (("a", {"m"}), ("b", {"m", "n"}), ("c", {"n"}))
    ]
    for e in engines:
        e.draining = e.name == draining
    queued = [
        Job(
            id=f"c{9 - i}",  # ids not in queue order
            cls=I,
            model=model,
            prompt_tokens=10,
            arrival=float(at),
            excluded={ex} if ex else set(),
            pinned=pin,
        )
        for i, (model, at, ex, pin) in enumerate(chats)
    ]
    longest = longest_waiting(queued, engines)
    for e in engines:
        mine = [j for j in queued if e.eligible(j)]
        expected = min(mine, key=lambda j: (j.arrival, j.id)) if mine else None
        assert longest.get(e.name) is expected
