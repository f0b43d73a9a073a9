"""Engines that join, drain and leave (DNS discovery), and the load of other proxy
replicas on an engine (the shared budget, docs/replicas.md), at virtual time."""

from __future__ import annotations

from proxy.scheduler import HeldReason, HoldRules, OthersLoad, Phase, Turn

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
    s.observe_others("a", OthersLoad(batch_prefill_tokens=700))
    small, large = submit(s, B, 300), submit(s, B, 301)
    assert sent(s) == {small.id: "a"}
    assert s.engines["a"].held_reason is HeldReason.PREFILL_BUDGET
    s.observe_others("a", OthersLoad(batch_prefill_tokens=0))
    s.on_first_token(small.id)
    assert sent(s) == {large.id: "a"}


def test_the_one_request_rule_still_holds_with_others_idle() -> None:
    s, _ = make(engine("a", budget={"initial_tokens": 1000, "min_tokens": 100}))
    s.observe_others("a", OthersLoad(batch_prefill_tokens=0))
    big = submit(s, B, 5000)
    assert sent(s) == {big.id: "a"}


def test_a_job_larger_than_the_budget_waits_while_others_prefill() -> None:
    s, _ = make(engine("a", budget={"initial_tokens": 1000, "min_tokens": 100}))
    s.observe_others("a", OthersLoad(batch_prefill_tokens=1))
    submit(s, B, 5000)
    assert sent(s) == {}


def test_another_replicas_interactive_work_holds_batch() -> None:
    s, _ = make(engine("a"), hold=HoldRules(batch_min_share=0.0))
    s.observe_others("a", OthersLoad(hold_for_interactive=True))
    j = submit(s, B, 10)
    assert sent(s) == {}
    assert s.engines["a"].turn is Turn.INTERACTIVE
    assert s.engines["a"].held_reason is HeldReason.INTERACTIVE_WAITING
    s.observe_others("a", OthersLoad())
    assert sent(s) == {j.id: "a"}
    check_turns(s)
