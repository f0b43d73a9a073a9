"""Engines that join, drain and leave (DNS discovery), and the load of other proxy
replicas on an engine (the shared budget, docs/replicas.md), at virtual time."""

from __future__ import annotations

from proxy.scheduler import HeldReason, HoldRules, Phase, ReplicaLoad, Turn

from .helpers import B, I, check_accounting, check_turns, engine, make, sent, submit


def test_a_joined_engine_takes_work() -> None:
    s, _ = make(engine("a", max_inflight=1))
    submit(s, I, 10)
    assert set(sent(s).values()) == {"a"}
    s.add_engine(engine("b"))
    j = submit(s, I, 10)
    assert sent(s) == {j.id: "b"}
    check_accounting(s)


def test_a_draining_engine_gets_nothing_new_and_its_work_finishes() -> None:
    s, _ = make(engine("a"), engine("b"))
    running = submit(s, I, 100)
    assert sent(s) == {running.id: "a"}  # least wait, then name order
    s.drain_engine("a")
    later = [submit(s, I, 10), submit(s, I, 10), submit(s, B, 10)]
    assert set(sent(s).values()) == {"b"}
    assert [j.engine for j in later] == ["b", "b", None]  # batch waits for b's chats
    assert not s.remove_engine("a"), "forgotten while a request still runs there"
    assert running.phase is Phase.PREFILL and s.engines["a"].inflight
    s.on_first_token(running.id)
    s.on_finished(running.id)
    assert s.remove_engine("a")
    assert list(s.engines) == ["b"]
    check_accounting(s)
    check_turns(s)


def test_queued_work_waits_for_an_engine_of_its_model_when_the_last_one_drains() -> None:
    s, _ = make(engine("a", max_inflight=1))
    first = submit(s, I, 10)
    sent(s)
    waiting = submit(s, I, 10)
    s.drain_engine("a")
    s.on_finished(first.id)
    assert sent(s) == {}
    assert s.engines_up_for("m") == []
    assert s.remove_engine("a")
    s.add_engine(engine("c"))
    assert sent(s) == {waiting.id: "c"}


def test_an_engine_back_in_dns_while_draining_takes_work_again() -> None:
    s, _ = make(engine("a"))
    s.drain_engine("a")
    j = submit(s, B, 10)
    assert sent(s) == {}
    s.add_engine(engine("a"))
    assert sent(s) == {j.id: "a"}
    assert not s.remove_engine("a"), "an engine that is not draining is never forgotten"


def test_other_replicas_batch_prefill_counts_against_the_budget() -> None:
    s, _ = make(engine("a", budget={"initial_tokens": 1000, "min_tokens": 100}))
    s.observe_others("a", ReplicaLoad(batch_prefill_tokens=700))
    small, large = submit(s, B, 300), submit(s, B, 301)
    assert sent(s) == {small.id: "a"}
    assert s.engines["a"].held_reason is HeldReason.PREFILL_BUDGET
    s.observe_others("a", ReplicaLoad(batch_prefill_tokens=0))
    s.on_first_token(small.id)
    assert sent(s) == {large.id: "a"}


def test_the_one_request_rule_still_holds_with_others_idle() -> None:
    s, _ = make(engine("a", budget={"initial_tokens": 1000, "min_tokens": 100}))
    s.observe_others("a", ReplicaLoad(batch_prefill_tokens=0))
    big = submit(s, B, 5000)
    assert sent(s) == {big.id: "a"}


def test_a_job_larger_than_the_budget_waits_while_others_prefill() -> None:
    s, _ = make(engine("a", budget={"initial_tokens": 1000, "min_tokens": 100}))
    s.observe_others("a", ReplicaLoad(batch_prefill_tokens=1))
    submit(s, B, 5000)
    assert sent(s) == {}


def test_another_replicas_interactive_work_holds_batch() -> None:
    s, _ = make(engine("a"), hold=HoldRules(batch_min_share=0.0))
    s.observe_others("a", ReplicaLoad(hold_for_interactive=True))
    j = submit(s, B, 10)
    assert sent(s) == {}
    assert s.engines["a"].turn is Turn.INTERACTIVE
    assert s.engines["a"].held_reason is HeldReason.INTERACTIVE_WAITING
    s.observe_others("a", ReplicaLoad())
    assert sent(s) == {j.id: "a"}
    check_turns(s)


def test_own_loads_are_this_replicas_batch_prefill_and_interactive_hold() -> None:
    s, _ = make(engine("a", max_inflight=2), engine("b", max_inflight=1))
    s.observe_others("a", ReplicaLoad(batch_prefill_tokens=50, hold_for_interactive=True))
    chat = submit(s, I, 10)
    batch = submit(s, B, 30)
    sent(s)
    assert (chat.engine, batch.engine) == ("a", "b")
    assert s.own_loads()["b"] == ReplicaLoad(0, False), "not reserved yet: not published"
    s.mark_reserved(batch.id)
    loads = s.own_loads()
    # the others' hold on a is not this replica's: it is never published back
    assert loads == {"a": ReplicaLoad(0, True), "b": ReplicaLoad(30, False)}
    s.on_first_token(chat.id)
    assert s.own_loads()["a"] == ReplicaLoad(0, False)
    submit(s, I, 10)
    submit(s, I, 10)
    sent(s)  # one fits on a (cap 2); the other waits for a or b: both hold
    assert s.own_loads() == {"a": ReplicaLoad(0, True), "b": ReplicaLoad(30, True)}


def test_a_refused_reservation_puts_the_job_back_with_the_fresher_view() -> None:
    s, _ = make(engine("a", budget={"initial_tokens": 1000, "min_tokens": 100}))
    first, second = submit(s, B, 400), submit(s, B, 400)
    assert set(sent(s)) == {first.id, second.id}
    assert s.reservation(second.id).in_prefill == 400  # type: ignore[union-attr]
    s.mark_reserved(first.id)
    r = s.reservation(second.id)
    assert r is not None
    assert (r.engine, r.tokens, r.in_prefill, r.budget) == ("a", 400, 800, 1000)
    assert not r.beside_interactive
    assert s.put_back(second.id, ReplicaLoad(batch_prefill_tokens=500))
    assert second.phase is Phase.QUEUED and second.engine is None and not second.excluded
    assert s.queues[B][0] is second
    assert sent(s) == {}, "put back, it is held by the others' tokens, not sent again"
    assert s.engines["a"].held_reason is HeldReason.PREFILL_BUDGET
    s.observe_others("a", ReplicaLoad())
    assert sent(s) == {second.id: "a"}
    s.on_first_token(first.id)
    assert not s.put_back(first.id, ReplicaLoad()), "in decode: too late to put back"
    check_accounting(s)


def test_interactive_work_needs_no_reservation() -> None:
    s, _ = make(engine("a"))
    chat = submit(s, I, 10)
    sent(s)
    assert s.reservation(chat.id) is None
    assert s.reservation("unknown") is None
