"""Whose turn it is, why batch is held, the time spent in each, and the decision log."""

from __future__ import annotations

import pytest

from proxy.scheduler import EngineLoad, HeldReason, Scheduler, Turn

from .helpers import B, I, check_accounting, engine, make, sent, submit

FIXED = {"initial_tokens": 1000, "min_tokens": 100, "max_tokens": 1000}


def turn(s: Scheduler, name: str = "e") -> tuple[Turn, HeldReason | None]:
    e = s.engines[name]
    return e.turn, e.held_reason


def test_a_fresh_engine_is_idle() -> None:
    s, _ = make(engine("e"))
    assert turn(s) == (Turn.IDLE, None)


def test_interactive_in_prefill_is_its_turn() -> None:
    s, _ = make(engine("e"))
    chat = submit(s, I, 10)
    s.dispatch()
    assert turn(s) == (Turn.INTERACTIVE, None)  # in prefill
    doc = submit(s, B, 10)
    s.dispatch()
    assert turn(s) == (Turn.INTERACTIVE, HeldReason.INTERACTIVE_WAITING)
    assert doc.held is HeldReason.INTERACTIVE_WAITING
    s.cancel(doc.id)
    s.on_first_token(chat.id)
    assert turn(s) == (Turn.IDLE, None)  # a chat in decode waits for no one


def test_batch_admitted_within_the_budget_is_its_turn() -> None:
    s, _ = make(engine("e", budget=FIXED))
    doc = submit(s, B, 600)
    assert turn(s) == (Turn.BATCH, None)  # admissible, not yet dispatched
    s.dispatch()
    assert turn(s) == (Turn.BATCH, None)
    submit(s, B, 600)
    s.dispatch()
    assert turn(s) == (Turn.BATCH, HeldReason.PREFILL_BUDGET)
    s.on_first_token(doc.id)
    s.dispatch()
    assert turn(s) == (Turn.BATCH, None)


def test_the_batch_cap_holds_batch_but_leaves_the_turn_to_batch() -> None:
    s, _ = make(engine("e", batch_max_inflight=1))
    submit(s, B, 10)
    submit(s, B, 10)
    s.dispatch()
    assert turn(s) == (Turn.BATCH, HeldReason.CONCURRENCY_CAP)


def test_the_hard_cap_saturates_the_engine() -> None:
    s, _ = make(engine("e", max_inflight=1))
    chat = submit(s, I, 10)
    s.dispatch()
    s.on_first_token(chat.id)
    assert turn(s) == (Turn.SATURATED, None)
    submit(s, B, 10)
    assert turn(s) == (Turn.SATURATED, HeldReason.CONCURRENCY_CAP)
    submit(s, I, 10)  # waiting for the cap, not for batch
    s.dispatch()
    assert turn(s) == (Turn.SATURATED, HeldReason.CONCURRENCY_CAP)


def test_no_kv_headroom_saturates_the_engine() -> None:
    s, _ = make(engine("e"))
    s.observe_load("e", EngineLoad(kv_usage=0.95))
    assert turn(s) == (Turn.IDLE, None)  # nothing waits for it
    submit(s, B, 10)
    s.dispatch()
    assert turn(s) == (Turn.SATURATED, HeldReason.KV_HEADROOM)


def test_a_down_engine_is_saturated_and_batch_for_it_is_held_as_unhealthy() -> None:
    s, _ = make(engine("e"))
    s.set_engine_up("e", False)
    assert turn(s) == (Turn.SATURATED, None)
    submit(s, B, 10)
    s.dispatch()
    assert turn(s) == (Turn.SATURATED, HeldReason.ENGINE_UNHEALTHY)
    s.set_engine_up("e", True)
    assert turn(s) == (Turn.BATCH, None)


def test_turns_are_per_engine_and_per_model() -> None:
    s, _ = make(engine("a", "m1", max_inflight=1), engine("b", "m2"))
    chat = submit(s, I, 10, model="m1")
    s.dispatch()
    s.on_first_token(chat.id)
    submit(s, I, 10, model="m1")  # queued for a (at its cap), not for b
    submit(s, B, 10, model="m1")
    doc = submit(s, B, 10, model="m2")
    assert sent(s) == {doc.id: "b"}
    assert turn(s, "a") == (Turn.SATURATED, HeldReason.CONCURRENCY_CAP)
    assert turn(s, "b") == (Turn.BATCH, None)


def test_a_job_excluded_from_an_engine_puts_no_pressure_on_it() -> None:
    s, _ = make(engine("a", max_inflight=1), engine("b"))
    x, y = submit(s, I, 10), submit(s, I, 10)
    assert sent(s) == {x.id: "a", y.id: "b"}
    s.on_first_token(x.id)
    s.on_first_token(y.id)
    assert s.on_failed(y.id, retry=True)  # back in the queue, never again to b
    doc = submit(s, B, 10)
    assert sent(s) == {doc.id: "b"}  # y waits for a only
    assert y.held is HeldReason.CONCURRENCY_CAP
    assert turn(s, "a") == (Turn.SATURATED, None)
    assert turn(s, "b") == (Turn.BATCH, None)
    check_accounting(s, [x, y, doc])


# -- time accounting -----------------------------------------------------------------


def test_turn_and_held_seconds_add_up_over_a_scripted_scenario() -> None:
    s, clock = make(engine("e", budget=FIXED))
    e = s.engines["e"]
    clock.advance(1.0)  # 0-1 idle
    chat = submit(s, I, 10)
    doc = submit(s, B, 500)
    s.dispatch()
    assert turn(s) == (Turn.INTERACTIVE, HeldReason.INTERACTIVE_WAITING)
    assert e.turn_since == 1.0
    clock.advance(2.0)  # 1-3 interactive, batch held for it
    s.on_first_token(chat.id)
    s.dispatch()
    doc2 = submit(s, B, 600)
    s.dispatch()
    assert turn(s) == (Turn.BATCH, HeldReason.PREFILL_BUDGET)
    clock.advance(1.0)  # 3-4 batch, held for the budget
    s.observe_load("e", EngineLoad(kv_usage=0.95))
    clock.advance(2.0)  # 4-6 saturated, KV
    s.set_engine_up("e", False)
    assert turn(s) == (Turn.SATURATED, HeldReason.ENGINE_UNHEALTHY)
    assert e.turn_since == 4.0  # the turn did not change, only the reason
    clock.advance(1.0)  # 6-7 saturated, unhealthy
    s.set_engine_up("e", True)
    clock.advance(1.0)  # 7-8 saturated, KV
    s.observe_load("e", EngineLoad())
    clock.advance(1.0)  # 8-9 batch, budget
    s.on_first_token(doc.id)
    s.dispatch()
    assert turn(s) == (Turn.BATCH, None)
    clock.advance(1.0)  # 9-10 batch, nothing held
    for j in (doc, doc2):
        s.on_first_token(j.id)
        s.on_finished(j.id)
    assert turn(s) == (Turn.IDLE, None)
    clock.advance(2.0)  # 10-12 idle
    s.on_finished(chat.id)
    s.tick()

    assert e.turn_seconds == {
        Turn.IDLE: 3.0,
        Turn.INTERACTIVE: 2.0,
        Turn.BATCH: 3.0,
        Turn.SATURATED: 4.0,
    }
    assert e.held_seconds == {
        HeldReason.INTERACTIVE_WAITING: 2.0,
        HeldReason.PREFILL_BUDGET: 2.0,
        HeldReason.KV_HEADROOM: 3.0,
        HeldReason.CONCURRENCY_CAP: 0.0,
        HeldReason.ENGINE_UNHEALTHY: 1.0,
    }
    assert sum(e.turn_seconds.values()) == clock.now()


def test_time_is_charged_only_when_an_event_or_tick_brings_it_up_to_date() -> None:
    s, clock = make(engine("a"), engine("b"))
    clock.advance(5.0)
    assert sum(s.engines["a"].turn_seconds.values()) == 0.0
    s.tick()
    for e in s.engines.values():
        assert e.turn_seconds[Turn.IDLE] == 5.0


# -- the decision log ----------------------------------------------------------------


def test_admitted_decisions_are_logged_with_the_budget() -> None:
    s, clock = make(engine("a", budget=FIXED), engine("b", budget=FIXED))
    clock.advance(2.0)
    chat = submit(s, I, 10)
    doc = submit(s, B, 10)
    out = sent(s)
    admitted = [d for d in s.log if d.admitted]
    assert [(d.job_id, d.engine, d.cls) for d in admitted] == [
        (chat.id, out[chat.id], I),
        (doc.id, out[doc.id], B),
    ]
    assert all(d.time == 2.0 and d.reason is None and d.budget == 1000 for d in admitted)


def test_a_held_job_is_logged_once_per_reason() -> None:
    s, _ = make(engine("e", budget=FIXED))
    first = submit(s, B, 500)
    s.dispatch()
    chat = submit(s, I, 10)
    doc = submit(s, B, 600)
    for _ in range(3):
        s.dispatch()
    s.on_first_token(chat.id)
    for _ in range(3):
        s.dispatch()
    s.observe_load("e", EngineLoad(kv_usage=0.99))
    s.dispatch()
    s.dispatch()
    s.observe_load("e", EngineLoad())
    s.on_first_token(first.id)
    s.dispatch()
    mine = [(d.admitted, d.reason) for d in s.log if d.job_id == doc.id]
    assert mine == [
        (False, HeldReason.INTERACTIVE_WAITING),
        (False, HeldReason.PREFILL_BUDGET),
        (False, HeldReason.KV_HEADROOM),
        (True, None),
    ]


def test_a_hold_is_logged_once_not_once_per_candidate_engine() -> None:
    s, _ = make(engine("a"), engine("b"))
    s.set_engine_up("a", False)
    s.set_engine_up("b", False)
    doc = submit(s, B, 10)
    s.dispatch()
    held = [d for d in s.log if not d.admitted]
    assert [(d.job_id, d.engine, d.reason) for d in held] == [
        (doc.id, "a", HeldReason.ENGINE_UNHEALTHY)
    ]


def test_interactive_holds_are_logged_too() -> None:
    s, _ = make(engine("e", max_inflight=1))
    submit(s, I, 10)
    chat = submit(s, I, 10)
    s.dispatch()
    s.dispatch()
    held = [(d.job_id, d.reason) for d in s.log if not d.admitted]
    assert held == [(chat.id, HeldReason.CONCURRENCY_CAP)]


@pytest.mark.parametrize("size", [1, 5])
def test_the_log_keeps_the_most_recent_decisions(size: int) -> None:
    s, _ = make(engine("e"), decision_log_size=size)
    chats = [submit(s, I, 10) for _ in range(8)]
    s.dispatch()
    assert [d.job_id for d in s.log] == [c.id for c in chats][-size:]
