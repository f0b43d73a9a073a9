"""The prefill budget's feedback loop (AIMD) and its percentile, at virtual time."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.clock import VirtualClock
from proxy.config import BudgetConfig
from proxy.scheduler import BudgetController, EngineLoad, HeldReason, Job, Scheduler
from proxy.scheduler.budget import percentile, time_weighted_percentile

from .helpers import B, I, engine, make, submit

# the budget section every test starts from, as an engine's settings take it
BUDGET: dict[str, Any] = {
    "initial_tokens": 8000,
    "min_tokens": 1000,
    "max_tokens": 10_000,
    "ttft_target_s": 1.0,
    "gap_target_s": 0.1,
    "aim": 0.8,
    "percentile": 0.95,
    "window_s": 30.0,
    "interval_s": 1.0,
    "min_samples": 5,
    "decrease": 0.5,
    "increase_tokens": 500,
}


def controller(**overrides: object) -> BudgetController:
    return BudgetController(BudgetConfig(**{**BUDGET, **overrides}), 0.0)


def judging_each_chat(**engine_settings: Any) -> tuple[Scheduler, VirtualClock]:
    """A scheduler over one engine ``e`` whose budget loop judges from one sample on."""
    return make(engine("e", budget={**BUDGET, "min_samples": 1}, **engine_settings))


def ttfts(c: BudgetController, t: float, *values: float) -> None:
    for v in values:
        c.observe_ttft(t, v)


# -- percentile ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([5.0], 0.95, 5.0),
        ([3.0, 1.0, 2.0], 0.5, 2.0),
        ([1.0, 2.0, 3.0, 4.0], 0.5, 2.0),  # nearest rank: ceil(0.5 * 4) = 2nd
        ([1.0, 2.0, 3.0, 4.0], 0.51, 3.0),
        (list(map(float, range(1, 21))), 0.95, 19.0),
        (list(map(float, range(1, 101))), 0.95, 95.0),
        (list(map(float, range(1, 101))), 0.99, 99.0),
        (list(map(float, range(1, 101))), 1.0, 100.0),
        ([4.0, 1.0], 0.01, 1.0),
        (list(map(float, range(1, 101))), 0.07, 7.0),
    ],
)
def test_percentile_is_the_nearest_rank(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == expected


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=300),
    hundredths=st.integers(1, 100),
)
def test_percentile_matches_an_exact_nearest_rank(values: list[float], hundredths: int) -> None:
    q = hundredths / 100
    rank = math.ceil(Fraction(hundredths, 100) * len(values))
    assert percentile(values, q) == sorted(values)[rank - 1]


# -- the loop --------------------------------------------------------------------


def test_a_missed_ttft_aim_halves_the_budget_once_an_interval_has_passed() -> None:
    c = controller()
    ttfts(c, 0.5, *[0.9] * 5)  # above aim x target = 0.8, below the target itself
    assert c.update(0.9, batch_waiting=True) == 8000  # less than an interval
    assert c.update(1.0, batch_waiting=True) == 4000
    assert c.history[-1] == (1.0, 4000)


def test_a_missed_gap_aim_cuts_as_well() -> None:
    c = controller()
    ttfts(c, 0.5, *[0.1] * 5)
    for _ in range(5):
        c.observe_gap(0.5, 0.09)  # above 0.8 x 0.1
    assert c.update(1.0, batch_waiting=False) == 4000


def test_a_long_gap_is_not_hidden_by_a_burst_of_short_ones() -> None:
    """Tokens held up and then delivered at once: one long gap, then many near
    zero. By tokens the p95 would be the short ones; by the streams' time it is
    the long gap, and the budget is cut, not grown."""
    c = controller()
    ttfts(c, 0.5, *[0.1] * 5)
    c.observe_gap(0.5, 1.2)
    for _ in range(200):
        c.observe_gap(0.5, 0.001)
    assert c.update(1.0, batch_waiting=True) == 4000


def test_time_weighted_percentile() -> None:
    assert time_weighted_percentile([0.01] * 10 + [1.0], 0.95) == 1.0
    assert time_weighted_percentile([0.05] * 20, 0.95) == 0.05
    assert time_weighted_percentile([0.0, 0.0], 0.95) == 0.0
    # 0.1 + 0.2 + 0.3 + 0.4 = 1.0: half of the time is spent in gaps up to 0.3
    assert time_weighted_percentile([0.4, 0.1, 0.3, 0.2], 0.5) == 0.3
    assert time_weighted_percentile([0.4, 0.1, 0.3, 0.2], 0.6) == 0.3  # at the edge
    assert time_weighted_percentile([0.4, 0.1, 0.3, 0.2], 0.61) == 0.4


def test_the_percentile_not_the_mean_is_judged() -> None:
    c = controller()
    ttfts(c, 0.5, *[0.1] * 18, 5.0)  # 1 bad sample in 19: p95 is the 19th... bad
    assert c.update(1.0, batch_waiting=False) == 4000
    c = controller()
    ttfts(c, 0.5, *[0.1] * 19, 5.0)  # 1 bad in 20: p95 is the 19th, fine
    assert c.update(1.0, batch_waiting=False) == 8000


def test_one_burst_costs_one_cut() -> None:
    c = controller()
    ttfts(c, 0.5, *[3.0] * 10)
    assert c.update(1.0, batch_waiting=False) == 4000
    for t in (2.0, 3.0, 10.0):  # the burst is still in the window, but judged already
        assert c.update(t, batch_waiting=False) == 4000
    ttfts(c, 10.5, *[3.0] * 4)  # fresh, but fewer than min_samples
    assert c.update(11.0, batch_waiting=False) == 4000
    ttfts(c, 11.5, 3.0)
    assert c.update(12.0, batch_waiting=False) == 2000
    assert [b for _, b in c.history] == [8000, 4000, 2000]


def test_samples_seen_at_the_instant_of_a_cut_are_judged_once() -> None:
    """In virtual time many first tokens share one instant; the cut they cause must
    not be repeated by the same samples on the next interval."""
    c = controller()
    ttfts(c, 1.0, *[3.0] * 5)
    assert c.update(1.0, batch_waiting=False) == 4000
    assert c.update(2.0, batch_waiting=False) == 4000
    # samples that arrive at that same instant, after the cut, are fresh ones
    ttfts(c, 2.0, *[3.0] * 5)
    assert c.update(3.0, batch_waiting=False) == 2000


def batch_in_prefill(s: Scheduler) -> Job:
    """A batch document dispatched and still in prefill: chats sent now share the
    engine with batch prefill, so the budget loop judges them."""
    doc = submit(s, B, 100)
    assert [d.job for d in s.dispatch()] == [doc]
    return doc


def chats_beside_batch(
    n: int, *, tokens: int = 100, **engine_settings: Any
) -> tuple[Scheduler, VirtualClock, list[Job]]:
    """``n`` chats of ``tokens`` dispatched to engine ``e`` beside a batch document in
    prefill, the budget loop judging from one sample on."""
    s, clock = judging_each_chat(**engine_settings)
    batch_in_prefill(s)
    chats = [submit(s, I, tokens) for _ in range(n)]
    s.dispatch()
    return s, clock, chats


def budget_after_an_interval(s: Scheduler, clock: VirtualClock) -> int:
    """Engine ``e``'s budget once an interval has passed and the loop has run."""
    clock.advance(1.0)
    s.tick()
    return s.engines["e"].budget.tokens


def test_through_the_scheduler_the_sample_that_triggers_a_cut_is_not_judged_again() -> None:
    s, clock, chats = chats_beside_batch(2, max_inflight=64)
    clock.advance(2.0)
    s.on_first_token(chats[0].id)  # 2 s from dispatch > 0.8 s: cut at once
    assert s.engines["e"].budget.tokens == 4000
    assert budget_after_an_interval(s, clock) == 4000


def test_the_cut_is_logged_with_the_numbers_judged() -> None:
    s, clock, (chat,) = chats_beside_batch(1, max_inflight=64)
    clock.advance(2.0)
    s.on_first_token(chat.id)
    (change,) = s.engines["e"].budget.changes
    assert (change.time, change.before, change.after, change.cause) == (2.0, 8000, 4000, "ttft")
    assert (change.ttft_s, change.ttft_samples, change.ttft_aim_s) == (2.0, 1, 0.8)
    assert (change.gap_s, change.gap_samples) == (None, 0)


def test_chats_that_never_shared_the_engine_with_batch_prefill_are_not_judged() -> None:
    s, clock = judging_each_chat(max_inflight=64)
    chat = submit(s, I, 100)  # no batch anywhere: its slow start is not batch's doing
    s.dispatch()
    clock.advance(2.0)
    s.on_first_token(chat.id)
    s.on_token_gap(chat.id, 5.0)
    assert budget_after_an_interval(s, clock) == 8000


def test_ttft_is_judged_from_dispatch_not_from_arrival() -> None:
    s, clock, (first,) = chats_beside_batch(1, tokens=10, max_inflight=2)
    late = submit(s, I, 10)  # waits at the proxy's cap for 5 s
    clock.advance(5.0)
    s.on_first_token(first.id)  # 5 s: cut
    assert s.engines["e"].budget.tokens == 4000
    s.on_finished(first.id)
    s.dispatch()
    assert late.dispatched_at == 5.0 and late.beside_batch
    clock.advance(0.1)
    s.on_first_token(late.id)  # 5.1 s from arrival, 0.1 s from dispatch
    assert budget_after_an_interval(s, clock) == 4000


def test_a_chat_in_flight_when_batch_is_sent_counts() -> None:
    s, clock = judging_each_chat()
    chat = submit(s, I, 10)
    s.dispatch()
    s.on_first_token(chat.id)
    assert not chat.beside_batch
    batch_in_prefill(s)
    assert chat.beside_batch
    s.on_token_gap(chat.id, 5.0)
    assert budget_after_an_interval(s, clock) == 4000


def test_no_change_without_enough_samples_except_growth() -> None:
    c = controller()
    ttfts(c, 0.5, *[9.0] * 4)
    assert c.update(1.0, batch_waiting=False) == 8000
    assert c.update(2.0, batch_waiting=True) == 8500


def test_growth_is_additive_only_while_batch_waits_and_is_capped() -> None:
    c = controller()
    assert c.update(1.0, batch_waiting=False) == 8000
    assert c.update(2.0, batch_waiting=True) == 8500
    assert c.update(2.5, batch_waiting=True) == 8500  # once per interval
    ttfts(c, 2.6, *[0.2] * 10)  # well within the aim
    assert c.update(3.0, batch_waiting=True) == 9000
    for t in range(4, 20):
        c.update(float(t), batch_waiting=True)
    assert c.tokens == 10_000


def test_cuts_stop_at_the_floor() -> None:
    c = controller()
    for t in range(1, 10):
        ttfts(c, t - 0.5, *[9.0] * 5)
        c.update(float(t), batch_waiting=True)
    assert c.tokens == 1000
    assert [b for _, b in c.history] == [8000, 4000, 2000, 1000]


def test_old_samples_leave_the_window() -> None:
    c = controller(window_s=5.0)
    ttfts(c, 0.0, *[9.0] * 5)
    assert c.signal(4.0)[0] == 9.0
    assert c.update(6.0, batch_waiting=False) == 8000  # older than the window
    assert c.signal(6.0) == (None, None)


@settings(max_examples=60, deadline=None)
@given(
    events=st.lists(
        st.tuples(
            st.floats(0.0, 3.0),  # clock advance
            st.lists(st.floats(0.0, 5.0), max_size=8),  # TTFT samples
            st.lists(st.floats(0.0, 0.5), max_size=8),  # gap samples
            st.booleans(),  # batch waiting
        ),
        max_size=60,
    ),
    min_tokens=st.integers(1, 4000),
    span=st.integers(0, 20_000),
)
def test_the_budget_moves_only_as_documented(
    events: list[tuple[float, list[float], list[float], bool]], min_tokens: int, span: int
) -> None:
    s = BudgetConfig(
        initial_tokens=min_tokens + span // 2,
        min_tokens=min_tokens,
        max_tokens=min_tokens + span,
        ttft_target_s=1.0,
        gap_target_s=0.1,
        min_samples=3,
        window_s=10.0,
    )
    c, now, last_run = BudgetController(s, 0.0), 0.0, 0.0
    for dt, ttft, gaps, waiting in events:
        now += dt
        for v in ttft:
            c.observe_ttft(now, v)
        for v in gaps:
            c.observe_gap(now, v)
        before, signal = c.tokens, c.signal(now)
        after = c.update(now, batch_waiting=waiting)
        assert s.min_tokens <= after <= s.max_tokens
        if now - last_run < s.interval_s:
            assert after == before
            continue
        last_run = now
        p_ttft, p_gap = signal
        over = (p_ttft or 0) > s.aim * s.ttft_target_s or (p_gap or 0) > s.aim * s.gap_target_s
        if over:
            assert after == max(s.min_tokens, int(before * s.decrease))
        elif waiting:
            assert after == min(s.max_tokens, before + s.increase_tokens)
        else:
            assert after == before


def test_settings_are_checked() -> None:
    for bad in (
        {"min_tokens": 0},
        {"initial_tokens": 100, "min_tokens": 200},
        {"initial_tokens": 100_000},
        {"decrease": 1.0},
        {"aim": 0.0},
        {"percentile": 1.5},
        {"ttft_target_s": 0.0},
    ):
        with pytest.raises(ValueError):
            BudgetConfig(**bad)


# -- the loop inside the scheduler -------------------------------------------------


def test_slow_first_tokens_cut_the_engines_budget_and_only_that_engines() -> None:
    budget = {**BUDGET, "min_samples": 2}
    s, clock = make(engine("a", budget=budget), engine("b", budget=budget))
    s.set_engine_up("b", False)  # everything below goes to a
    batch_in_prefill(s)  # a's batch prefill, shared with the chats below
    chats = [submit(s, I, 100) for _ in range(3)]
    assert {d.engine for d in s.dispatch()} == {"a"}
    s.set_engine_up("b", True)
    clock.advance(0.5)
    s.on_first_token(chats[0].id)
    clock.advance(0.5)  # an interval passes; 0.5 and 1.0 s from dispatch: p95 1.0 > 0.8
    s.on_first_token(chats[1].id)
    assert s.engines["a"].budget.tokens == 4000
    assert s.engines["b"].budget.tokens == 8000


def test_batch_gaps_do_not_count_and_interactive_gaps_do() -> None:
    s, clock = judging_each_chat()
    doc = submit(s, B, 100)
    s.dispatch()
    s.on_first_token(doc.id)
    s.on_token_gap(doc.id, 5.0)
    assert budget_after_an_interval(s, clock) == 8000
    batch_in_prefill(s)
    chat = submit(s, I, 10)
    s.dispatch()
    s.on_first_token(chat.id)
    s.on_token_gap(chat.id, 5.0)
    assert budget_after_an_interval(s, clock) == 4000


def test_the_budget_grows_while_batch_waits_on_it() -> None:
    s, clock = make(engine("e", budget={**BUDGET, "initial_tokens": 1000}))
    submit(s, B, 900)
    submit(s, B, 900)
    s.dispatch()
    assert s.engines["e"].held_reason == "prefill_budget"
    assert budget_after_an_interval(s, clock) == 1500
    s.observe_load("e", EngineLoad(kv_usage=0.95))  # now held for KV, not the budget
    assert budget_after_an_interval(s, clock) == 1500  # not waiting on the budget: no growth
    assert s.engines["e"].held_reason == "kv_headroom"


def test_a_budget_that_grows_after_a_hold_frees_the_job_it_held() -> None:
    """The budget loop runs at the end of the dispatch that held a job for the budget;
    when it grows the budget there, the job no longer says it is held for it (the
    turn says it may go), and taking it next is not logged as a second hold."""
    grows = {**BUDGET, "initial_tokens": 1, "min_tokens": 1, "max_tokens": 2}
    grows |= {"interval_s": 0.5, "min_samples": 1, "increase_tokens": 1}
    s, clock = make(engine("e", max_inflight=3, batch_max_inflight=2, budget=grows))
    for _ in range(8):
        clock.advance(0.5)
        s.tick()
    first, second = submit(s, B, 1), submit(s, B, 1)
    clock.advance(0.5)  # the budget loop is due at the dispatch
    assert [d.job for d in s.dispatch()] == [first]
    e = s.engines["e"]
    assert e.budget.tokens == 2 and e.held_reason is None
    assert second.held is None
    holds = [d for d in s.log if d.job_id == second.id and not d.admitted]
    assert [d.reason for d in holds] == [HeldReason.PREFILL_BUDGET]
    assert [d.job for d in s.dispatch()] == [second]
