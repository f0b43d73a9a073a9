"""/turn, /turn/log and the whoseturn_turn gauge say the same thing as the scheduler,
at every step of a scripted scenario (virtual time, no I/O)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.admission import Admission
from proxy.api.turn import log_body, turn_body
from proxy.clock import VirtualClock
from proxy.config import EngineConfig
from proxy.metrics import ProxyMetrics
from proxy.scheduler import (
    EngineLoad,
    HeldReason,
    Job,
    Scheduler,
    TrafficClass,
    Turn,
)
from proxy.scheduler.turns import sentence

BATCH, CHAT = TrafficClass.BATCH, TrafficClass.INTERACTIVE


def gauge_turns(metrics: ProxyMetrics) -> dict[str, str]:
    """engine -> the turn whose whoseturn_turn sample is 1 (exactly one must be)."""
    text = generate_latest(metrics.registry).decode()
    ones: dict[str, list[str]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "whoseturn_turn":
            continue
        for s in family.samples:
            ones.setdefault(s.labels["engine"], [])
            if s.value == 1.0:
                ones[s.labels["engine"]].append(s.labels["turn"])
            else:
                assert s.value == 0.0
    for engine, turns in ones.items():
        assert len(turns) == 1, (engine, turns)
    return {engine: turns[0] for engine, turns in ones.items()}


class Scenario:
    def __init__(self) -> None:
        self.clock = VirtualClock()
        engine = EngineConfig(name="e0", models=frozenset({"m"}), batch_max_inflight=8)
        self.scheduler = Scheduler([engine], self.clock)
        self.admission = Admission(self.scheduler)
        self.metrics = ProxyMetrics(self.scheduler, 0.3)
        self.dispatched: list[str] = []

    def submit(self, job_id: str, cls: TrafficClass, tokens: int) -> None:
        job = Job(id=job_id, cls=cls, model="m", prompt_tokens=tokens, arrival=self.clock.now())
        self.scheduler.submit(job)
        self.dispatch()

    def dispatch(self) -> None:
        self.dispatched += [d.job.id for d in self.scheduler.dispatch()]

    def check(self, turn: Turn, reason: HeldReason | None) -> None:
        engine = self.scheduler.engines["e0"]
        assert (engine.turn, engine.held_reason) == (turn, reason)
        report = turn_body(self.admission)["engines"][0]
        assert (report["turn"], report["held_reason"]) == (turn.value, reason and reason.value)
        assert gauge_turns(self.metrics) == {"e0": turn.value}
        words = sentence(report)
        assert words.startswith("e0: ")
        if turn is Turn.INTERACTIVE:
            assert "interactive's turn" in words
        if reason is not None:
            assert "batch held" in words
        last = log_body(self.admission, 1)["decisions"]
        if last:
            decision = self.scheduler.log[-1]
            assert last[0]["request_id"] == decision.job_id
            assert last[0]["reason"] == (decision.reason and decision.reason.value)
            assert last[0]["budget"] == decision.budget


def step(s: Scenario, action: Callable[[], None], turn: Turn, reason: HeldReason | None) -> None:
    s.clock.advance(1.0)
    action()
    s.check(turn, reason)


def test_turn_gauge_report_and_log_agree_at_every_step() -> None:
    s = Scenario()
    sched = s.scheduler
    s.check(Turn.IDLE, None)
    step(s, lambda: s.submit("b1", BATCH, 8000), Turn.BATCH, None)
    step(s, lambda: s.submit("b2", BATCH, 8000), Turn.BATCH, HeldReason.PREFILL_BUDGET)
    assert s.dispatched == ["b1"]
    assert sched.log[-1].reason is HeldReason.PREFILL_BUDGET
    step(s, lambda: s.submit("i1", CHAT, 500), Turn.INTERACTIVE, HeldReason.INTERACTIVE_WAITING)
    assert s.dispatched == ["b1", "i1"]
    step(s, lambda: sched.on_first_token("i1"), Turn.BATCH, HeldReason.PREFILL_BUDGET)

    def b1_first() -> None:
        sched.on_first_token("b1")
        s.dispatch()

    step(s, b1_first, Turn.BATCH, None)
    assert s.dispatched == ["b1", "i1", "b2"]

    def kv_full() -> None:
        sched.observe_load("e0", EngineLoad(kv_usage=0.95))
        s.submit("b3", BATCH, 100)

    step(s, kv_full, Turn.SATURATED, HeldReason.KV_HEADROOM)
    step(s, lambda: sched.set_engine_up("e0", False), Turn.SATURATED, HeldReason.ENGINE_UNHEALTHY)

    def recover() -> None:
        sched.set_engine_up("e0", True)
        sched.observe_load("e0", EngineLoad(kv_usage=0.1))
        s.dispatch()

    step(s, recover, Turn.BATCH, None)

    def finish_all() -> None:
        for job_id in ("b1", "b2", "b3", "i1"):
            sched.on_finished(job_id)
        s.dispatch()

    step(s, finish_all, Turn.IDLE, None)
    report = turn_body(s.admission)["engines"][0]
    assert sum(report["turn_seconds"].values()) == pytest.approx(s.clock.now())
    assert report["turn_seconds"]["saturated"] == pytest.approx(2.0)
    assert report["held_seconds"]["prefill_budget"] == pytest.approx(2.0)
    assert report["held_seconds"]["interactive_waiting"] == pytest.approx(1.0)


def test_turn_log_shows_each_budget_move_with_the_numbers_judged() -> None:
    from datetime import datetime

    s = Scenario()
    s.submit("doc", BATCH, 100)  # batch in prefill: the chats below share the engine
    for i in range(20):
        s.submit(f"chat-{i}", CHAT, 50)
    s.clock.advance(2.0)
    for i in range(20):
        s.scheduler.on_first_token(f"chat-{i}")  # 2 s from dispatch
    s.clock.advance(1.0)
    s.scheduler.tick()  # the next interval judges the 20 samples: cut
    [move] = log_body(s.admission, 10)["budget"]
    assert (move["engine"], move["before"], move["after"], move["cause"]) == (
        "e0",
        8192,
        4096,
        "ttft",
    )
    assert (move["ttft_s"], move["ttft_samples"], move["ttft_aim_s"]) == (2.0, 20, 0.24)
    assert datetime.fromisoformat(move["time"]).tzinfo is not None


def test_a_prompt_over_the_budget_is_named_as_the_single_request_rule() -> None:
    s = Scenario()
    s.submit("big", BATCH, 20_000)  # over the 8,192 budget, alone in prefill: admitted
    s.submit("next", BATCH, 100)
    words = sentence(turn_body(s.admission)["engines"][0])
    assert "20,000 tokens in prefill, over the 8,192 budget: one prompt is always allowed" in words
    assert "of 8,192 budget tokens" not in words
