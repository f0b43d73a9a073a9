"""Who goes where and when: interactive first, routing, the batch budget, failures."""

from __future__ import annotations

import pytest

from proxy.clock import VirtualClock
from proxy.scheduler import (
    EngineLoad,
    HeldReason,
    HoldRules,
    Phase,
    Scheduler,
    Turn,
    UnknownModel,
)
from proxy.scheduler.routing import AffinityMap

from .helpers import B, I, assert_held_until, check_accounting, engine, job, make, sent, submit

BUDGET = {"initial_tokens": 1000, "min_tokens": 100, "max_tokens": 4000}


# -- intake ----------------------------------------------------------------------


def test_a_job_for_a_model_no_engine_serves_is_refused() -> None:
    s, _ = make(engine("a", "m1"), engine("b", "m2"))
    with pytest.raises(UnknownModel):
        s.submit(job(I, 10, model="m3"))
    assert s.models() == ["m1", "m2"]
    assert not s.jobs


def test_duplicate_ids_and_engine_names_are_refused() -> None:
    s, _ = make(engine("a"))
    s.submit(job(I, 10, id="x"))
    with pytest.raises(ValueError):
        s.submit(job(B, 10, id="x"))
    with pytest.raises(ValueError):
        make(engine("a"), engine("a"))
    # No engine yet is allowed (a DNS group may have no address at start); it
    # serves no model until one joins.
    with pytest.raises(UnknownModel):
        Scheduler([], VirtualClock()).submit(job(I, 10))


# -- interactive first -------------------------------------------------------------


def test_interactive_goes_at_once_even_into_a_busy_engine() -> None:
    s, _ = make(engine("e", budget=BUDGET))
    docs = [submit(s, B, 900), submit(s, B, 900)]
    assert sent(s) == {docs[0].id: "e"}
    chat = submit(s, I, 5000)  # far over the budget, and the engine has prefill in flight
    assert sent(s) == {chat.id: "e"}
    assert chat.phase is Phase.PREFILL and chat.dispatched_at == 0.0


def test_interactive_waits_only_for_the_hard_cap() -> None:
    s, _ = make(engine("a", max_inflight=2), engine("b", max_inflight=1))
    chats = [submit(s, I, 10) for _ in range(4)]
    assert sorted(sent(s).values()) == ["a", "a", "b"]
    assert chats[3].phase is Phase.QUEUED and chats[3].held is HeldReason.CONCURRENCY_CAP
    s.on_finished(chats[0].id)
    assert sent(s) == {chats[3].id: "a"}


def test_interactive_waits_for_a_down_engine_and_goes_when_it_is_up() -> None:
    s, _ = make(engine("a"))
    s.set_engine_up("a", False)
    chat = submit(s, I, 10)
    assert_held_until(s, chat, HeldReason.ENGINE_UNHEALTHY, lambda: s.set_engine_up("a", True), "a")


def test_interactive_goes_to_the_least_predicted_wait() -> None:
    s, _ = make(engine("a", budget=BUDGET), engine("b", budget=BUDGET), engine("c", "other"))
    big = submit(s, B, 900)
    assert sent(s) == {big.id: "a"}  # ties break on in-flight count, then name
    chat = submit(s, I, 100)
    assert sent(s) == {chat.id: "b"}  # a has 900 tokens in prefill, b none
    s.on_first_token(big.id)  # a's prefill is done; b still has the chat's 100
    assert sent(s) == {}
    nxt = submit(s, I, 100)
    assert sent(s) == {nxt.id: "a"}


def test_a_conversation_stays_on_its_engine_within_the_slack() -> None:
    s, _ = make(engine("a"), engine("b"), affinity_slack_tokens=1000)
    first = submit(s, I, 10, affinity="conv")
    assert sent(s) == {first.id: "a"}  # equal waits and counts: a by name
    filler = submit(s, I, 900, affinity="conv")
    assert sent(s) == {filler.id: "a"}  # a: 910, b: 900
    again = submit(s, I, 50, affinity="conv")
    assert sent(s) == {again.id: "a"}  # a: 960, b: 50; 910 worse is within 1000
    other = submit(s, I, 50)  # no conversation: least wait
    assert sent(s) == {other.id: "b"}


def test_a_conversation_moves_when_its_engine_is_clearly_worse() -> None:
    s, _ = make(engine("a"), engine("b"), affinity_slack_tokens=1000)
    first = submit(s, I, 10, affinity="conv")
    assert sent(s) == {first.id: "a"}
    filler = submit(s, I, 2000)
    assert sent(s) == {filler.id: "b"}  # a has 10 in prefill
    s.on_first_token(filler.id)
    more = submit(s, I, 2000)
    assert sent(s) == {more.id: "b"}  # a 2010 vs b 2000
    s.on_first_token(first.id)
    s.on_first_token(more.id)
    hog = submit(s, I, 1500)
    assert sent(s) == {hog.id: "a"}
    again = submit(s, I, 10, affinity="conv")
    assert sent(s) == {again.id: "b"}  # a 1510 vs b 10: worse by more than 1000
    # and the conversation now lives on b
    s.on_first_token(hog.id)
    s.on_first_token(again.id)
    third = submit(s, I, 10, affinity="conv")
    assert sent(s) == {third.id: "b"}


def test_affinity_is_ignored_when_its_engine_cannot_take_the_job() -> None:
    s, _ = make(engine("a", max_inflight=1), engine("b"))
    first = submit(s, I, 10, affinity="conv")
    assert sent(s) == {first.id: "a"}
    again = submit(s, I, 10, affinity="conv")
    assert sent(s) == {again.id: "b"}


def test_the_affinity_map_forgets_the_least_recently_used() -> None:
    m = AffinityMap(capacity=2)
    m.remember("x", "a")
    m.remember("y", "b")
    assert m.get("x") == "a"  # x is now the most recent
    m.remember("z", "c")
    assert (m.get("x"), m.get("y"), m.get("z")) == ("a", None, "c")
    m.remember(None, "a")
    assert m.get(None) is None


# -- batch within the budget ---------------------------------------------------------


def test_batch_is_admitted_within_the_budget() -> None:
    s, _ = make(engine("e", budget=BUDGET))
    docs = [submit(s, B, 400) for _ in range(3)]
    assert sent(s) == {docs[0].id: "e", docs[1].id: "e"}
    assert docs[2].held is HeldReason.PREFILL_BUDGET
    s.on_first_token(docs[0].id)  # 400 in prefill: 800 fits in 1000
    assert sent(s) == {docs[2].id: "e"}


def test_batch_waits_while_interactive_is_in_prefill() -> None:
    s, _ = make(engine("e", budget=BUDGET))
    chat = submit(s, I, 700)
    s.dispatch()
    doc = submit(s, B, 400)
    assert_held_until(
        s, doc, HeldReason.INTERACTIVE_WAITING, lambda: s.on_first_token(chat.id), "e"
    )


def test_a_prompt_larger_than_the_budget_runs_alone() -> None:
    s, _ = make(engine("e", budget=BUDGET))
    small = submit(s, B, 10)
    huge = submit(s, B, 50_000)
    assert sent(s) == {small.id: "e"}
    assert huge.held is HeldReason.PREFILL_BUDGET
    s.on_first_token(small.id)
    assert sent(s) == {huge.id: "e"}  # nothing else in prefill: it may run
    later = submit(s, B, 10)
    assert_held_until(s, later, HeldReason.PREFILL_BUDGET, lambda: s.on_first_token(huge.id), "e")


def test_a_held_large_job_holds_later_small_ones_on_its_engine() -> None:
    s, _ = make(engine("a", "m", "x", budget=BUDGET), engine("b", "x", budget=BUDGET))
    first = submit(s, B, 600)
    large = submit(s, B, 600)
    small = submit(s, B, 100)  # would fit beside the first, but must not overtake
    elsewhere = submit(s, B, 100, model="x")  # a is held; b serves x
    assert sent(s) == {first.id: "a", elsewhere.id: "b"}
    assert large.held is HeldReason.PREFILL_BUDGET and small.held is None
    s.on_first_token(first.id)
    assert sent(s) == {large.id: "a", small.id: "a"}


def test_batch_goes_to_the_engine_with_the_least_prefill() -> None:
    s, _ = make(engine("a", budget=BUDGET), engine("b", budget=BUDGET))
    docs = [submit(s, B, 300) for _ in range(4)]
    assert sent(s) == {docs[0].id: "a", docs[1].id: "b", docs[2].id: "a", docs[3].id: "b"}


def test_batch_held_while_interactive_is_queued_at_the_cap_names_the_cap() -> None:
    # an interactive job queued is one every engine refused: the engine is saturated,
    # and the held reason says the same as the turn (issue #11)
    s, _ = make(engine("e", max_inflight=2, batch_max_inflight=2))
    chats = [submit(s, I, 10) for _ in range(3)]
    s.dispatch()
    for c in chats[:2]:
        s.on_first_token(c.id)
    doc = submit(s, B, 10)
    assert sent(s) == {}  # at the cap; and when a slot frees, the queued chat takes it
    s.on_finished(chats[0].id)
    assert sent(s) == {chats[2].id: "e"}
    assert doc.held is HeldReason.CONCURRENCY_CAP
    assert (s.engines["e"].turn, s.engines["e"].held_reason) == (Turn.SATURATED, doc.held)
    s.on_first_token(chats[2].id)
    s.on_finished(chats[1].id)
    assert sent(s) == {doc.id: "e"}


@pytest.mark.parametrize(
    ("settings", "inflight", "load", "reason"),
    [
        ({"max_inflight": 2}, 2, EngineLoad(), HeldReason.CONCURRENCY_CAP),
        ({"batch_max_inflight": 2}, 2, EngineLoad(), HeldReason.CONCURRENCY_CAP),
        ({}, 0, EngineLoad(kv_usage=0.9), HeldReason.KV_HEADROOM),
        ({"kv_high_watermark": 0.5}, 0, EngineLoad(kv_usage=0.6), HeldReason.KV_HEADROOM),
    ],
)
def test_batch_needs_concurrency_and_kv_headroom(
    settings: dict[str, int], inflight: int, load: EngineLoad, reason: HeldReason
) -> None:
    s, _ = make(engine("e", **settings))
    for d in [submit(s, B, 10) for _ in range(inflight)]:
        s.dispatch()
        s.on_first_token(d.id)
    s.observe_load("e", load)
    doc = submit(s, B, 10)
    assert sent(s) == {}
    assert doc.held is reason and s.engines["e"].held_reason is reason
    s.observe_load("e", EngineLoad(kv_usage=0.1))
    for j in list(s.engines["e"].inflight):
        s.on_finished(j)
    assert sent(s) == {doc.id: "e"}


def test_nothing_is_dispatched_to_a_down_engine_until_it_is_up() -> None:
    s, _ = make(engine("a"), engine("b"))
    s.set_engine_up("a", False)
    chat, doc = submit(s, I, 10), submit(s, B, 10)
    assert sent(s) == {chat.id: "b"}
    s.on_first_token(chat.id)
    assert sent(s) == {doc.id: "b"}
    s.set_engine_up("b", False)
    held = submit(s, B, 10)
    assert_held_until(s, held, HeldReason.ENGINE_UNHEALTHY, lambda: s.set_engine_up("a", True), "a")


# -- failures and cancels -------------------------------------------------------------


def test_a_retried_failure_goes_to_the_head_of_its_queue_and_not_back() -> None:
    s, _ = make(engine("a", budget=BUDGET), engine("b", budget=BUDGET))
    docs = [submit(s, B, 900) for _ in range(4)]
    assert sent(s) == {docs[0].id: "a", docs[1].id: "b"}
    assert s.on_failed(docs[0].id, retry=True)
    assert list(s.queues[B]) == [docs[0], docs[2], docs[3]]
    assert docs[0].excluded == {"a"} and docs[0].attempts == 1
    assert docs[0].phase is Phase.QUEUED and docs[0].engine is None
    # docs[0] is held on b only (a is excluded for it), so docs[2] may take a
    assert sent(s) == {docs[2].id: "a"}
    assert docs[0].held is HeldReason.PREFILL_BUDGET
    s.on_first_token(docs[1].id)
    assert sent(s) == {docs[0].id: "b"}
    check_accounting(s, docs)


def test_a_failure_with_no_other_engine_is_dropped() -> None:
    s, _ = make(engine("a"), engine("b", "other"))
    chat = submit(s, I, 10)
    s.dispatch()
    assert not s.on_failed(chat.id, retry=True)
    assert chat.id not in s.jobs and chat.phase is Phase.DONE
    assert not s.engines["a"].inflight


def test_a_failure_with_the_other_engine_down_is_dropped() -> None:
    s, _ = make(engine("a"), engine("b"))
    chat = submit(s, I, 10)
    s.dispatch()
    s.set_engine_up("b", False)
    assert not s.on_failed(chat.id, retry=True)
    assert chat.id not in s.jobs


def test_a_failure_without_retry_is_dropped() -> None:
    s, _ = make(engine("a"), engine("b"))
    chat = submit(s, I, 10)
    s.dispatch()
    assert not s.on_failed(chat.id, retry=False)
    assert not s.jobs and not s.queues[I]


def test_a_second_report_of_one_failure_changes_nothing() -> None:
    s, _ = make(engine("a"), engine("b"), engine("c"))
    doc = submit(s, B, 10)
    s.dispatch()
    assert s.on_failed(doc.id, retry=True)
    assert not s.on_failed(doc.id, retry=True)  # already requeued
    assert not s.on_failed(doc.id, retry=False)
    assert list(s.queues[B]) == [doc] and doc.id in s.jobs and doc.excluded == {"a"}
    assert sent(s) == {doc.id: "b"}
    check_accounting(s, [doc])
    assert not s.on_failed("nobody", retry=True)


def test_cancel_a_queued_job() -> None:
    s, _ = make(engine("e", budget=BUDGET))
    first, second = submit(s, B, 900), submit(s, B, 900)
    s.dispatch()
    assert s.cancel(second.id) is second
    assert not s.queues[B] and second.phase is Phase.DONE
    assert s.cancel(second.id) is None
    check_accounting(s, [first, second])


def test_cancel_an_in_flight_job_frees_its_budget() -> None:
    s, _ = make(engine("e", budget=BUDGET))
    first, second = submit(s, B, 900), submit(s, B, 900)
    s.dispatch()
    assert s.cancel(first.id) is first
    assert first.id not in s.engines["e"].inflight
    assert sent(s) == {second.id: "e"}
    check_accounting(s, [first, second])


def test_finished_jobs_leave_and_late_reports_are_ignored() -> None:
    s, _ = make(engine("e"))
    chat = submit(s, I, 10)
    s.dispatch()
    s.on_first_token(chat.id)
    first_token_at = chat.first_token_at
    s.on_first_token(chat.id)  # a duplicate report
    assert chat.first_token_at == first_token_at
    assert s.on_finished(chat.id) is chat
    assert s.on_finished(chat.id) is None
    s.on_first_token(chat.id)
    s.on_token_gap(chat.id, 9.0)
    assert chat.phase is Phase.DONE and not s.engines["e"].budget.gaps.values(0.0)


def test_a_chat_stuck_in_prefill_stops_holding_batch_after_the_timeout() -> None:
    s, clock = make(engine("e"), hold=HoldRules(hold_timeout_s=10.0))
    chat = submit(s, I, 10)
    s.dispatch()
    doc = submit(s, B, 10)
    assert sent(s) == {}
    assert doc.held is HeldReason.INTERACTIVE_WAITING
    clock.advance(9.9)
    assert sent(s) == {}
    clock.advance(0.1)
    assert sent(s) == {doc.id: "e"}  # its first token never came: it holds no more
    assert chat.phase is Phase.PREFILL


def sustained_chat(s: Scheduler, clock: VirtualClock, chats: int) -> tuple[int, int]:
    """Chats of 950 tokens one after another, the next always sent while the last is
    in prefill, beside a batch job of 1,000-token documents; a document sent takes
    its first token at once. Returns the prompt tokens sent: chat, batch."""
    for _ in range(40):
        submit(s, B, 1000)
    chat_tokens = batch_tokens = 0
    prev = submit(s, I, 950)
    s.dispatch()
    for _ in range(chats):
        nxt = submit(s, I, 950)
        for d in s.dispatch():
            if d.job.cls is B:
                batch_tokens += d.job.prompt_tokens
                s.on_first_token(d.job.id)
            else:
                chat_tokens += d.job.prompt_tokens
        s.on_first_token(prev.id)
        s.on_finished(prev.id)
        prev = nxt
        clock.advance(0.1)
    return chat_tokens, batch_tokens


def test_under_sustained_chat_batch_keeps_its_minimum_share_of_prefill() -> None:
    s, clock = make(engine("e"), hold=HoldRules(batch_min_share=0.05))
    chat, batch = sustained_chat(s, clock, 400)
    assert 0.045 <= batch / (batch + chat) <= 0.055, (chat, batch)


def test_without_the_bound_sustained_chat_starves_batch() -> None:
    s, clock = make(engine("e"), hold=HoldRules(batch_min_share=0.0))
    assert sustained_chat(s, clock, 400)[1] == 0
