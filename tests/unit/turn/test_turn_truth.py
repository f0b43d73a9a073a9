"""What ``/turn``, ``/turn/log``, ``/turn/history`` and the sentence say is true and
readable: wall-clock ISO times everywhere, a headline that names the turn now
beside its share of the last seconds, a per-second history served from the
proxy's own ring, and a budget at its floor or falling that says which signal
cut it (virtual time, no I/O)."""

from __future__ import annotations

from datetime import datetime
from itertools import pairwise

from proxy.api.turn import history_body, log_body, turn_body
from proxy.scheduler import Turn
from proxy.scheduler.turns import sentence

from .test_turn_agreement import BATCH, CHAT, Scenario


def iso(value: str) -> datetime:
    when = datetime.fromisoformat(value)
    assert when.utcoffset() is not None and when.utcoffset().total_seconds() == 0, value
    return when


def flicker(s: Scenario, seconds: int) -> None:
    """A chat every 100 ms, in prefill for 20 ms of it, beside batch: the turn
    flips twenty times a second."""
    s.submit("doc", BATCH, 100)
    for i in range(seconds * 10):
        s.submit(f"c{i}", CHAT, 50)
        s.clock.advance(0.02)
        s.scheduler.on_first_token(f"c{i}")
        s.scheduler.on_finished(f"c{i}")
        s.clock.advance(0.08)


def test_every_time_in_turn_and_the_log_is_iso_utc() -> None:
    s = Scenario()
    flicker(s, 3)
    body = turn_body(s.admission)
    iso(body["time"])
    engine = body["engines"][0]
    iso(engine["turn_since"])
    assert all(iso(t) for t, _ in engine["budget"]["history"])
    log = log_body(s.admission, 100)
    assert log["decisions"] and all(iso(d["time"]) for d in log["decisions"])
    history = history_body(s.admission, 60)
    iso(history["time"])
    assert all(iso(h["time"]) for h in history["engines"][0]["history"])


def test_the_headline_gives_the_turn_now_and_its_share_of_the_last_ten_seconds() -> None:
    s = Scenario()
    flicker(s, 12)
    report = turn_body(s.admission)["engines"][0]
    assert report["turn"] == "batch"
    recent = report["recent"]
    assert recent["window_s"] == 10 and recent["turn"] == "batch"
    assert 0.75 < recent["shares"]["batch"] < 0.85  # 80 ms of every 100
    assert 0.15 < recent["shares"]["interactive"] < 0.25
    words = sentence(report)
    assert words.startswith(f"e0: batch's turn now; batch {recent['shares']['batch']:.0%} of ")
    assert "of the last 10 s — " in words
    # a chat now flips the instant turn; the share over the window barely moves
    s.submit("late", CHAT, 50)
    flipped = turn_body(s.admission)["engines"][0]
    assert flipped["turn"] == "interactive" and flipped["recent"]["turn"] == "batch"
    assert sentence(flipped).startswith("e0: interactive's turn now; batch ")


def test_turn_history_gives_each_second_and_its_shares() -> None:
    s = Scenario()
    s.clock.advance(0.5)
    s.submit("doc", BATCH, 100)  # batch from t=0.5
    s.clock.advance(2.0)
    s.submit("chat", CHAT, 50)  # interactive from t=2.5
    s.clock.advance(1.0)
    s.scheduler.on_first_token("chat")  # batch again from t=3.5
    s.clock.advance(0.25)  # now t=3.75, nothing charged since t=3.5 (a read adds it)
    [engine] = history_body(s.admission, 60)["engines"]
    seconds = [h["turns"] for h in engine["history"]]
    assert [round(sec["idle"], 3) for sec in seconds] == [0.5, 0.0, 0.0, 0.0]
    assert [round(sec["batch"], 3) for sec in seconds] == [0.5, 1.0, 0.5, 0.25]
    assert [round(sec["interactive"], 3) for sec in seconds] == [0.0, 0.0, 0.5, 0.5]
    starts = [iso(h["time"]) for h in engine["history"]]
    steps = [(b - a).total_seconds() for a, b in pairwise(starts)]
    assert all(abs(step - 1.0) < 0.01 for step in steps)
    assert len(history_body(s.admission, 2)["engines"][0]["history"]) == 2


def test_the_history_ring_is_bounded() -> None:
    s = Scenario()
    s.submit("doc", BATCH, 100)
    for _ in range(400):
        s.clock.advance(1.0)
        s.scheduler.tick()
    history = history_body(s.admission, 10_000)
    assert history["seconds"] == 300 and len(history["engines"][0]["history"]) == 300
    engine = s.scheduler.engines["e0"]
    assert len(engine.turn_history.seconds(0.0, 0.0, Turn.BATCH)) == 300


def cut_to_the_floor(s: Scenario) -> None:
    """Slow first tokens beside batch prefill until the budget is at its floor."""
    budget = s.scheduler.engines["e0"].budget
    n = 0
    s.submit("doc", BATCH, 100)
    while budget.tokens > budget.settings.min_tokens:
        for _ in range(20):
            s.submit(f"slow{n}", CHAT, 50)
            n += 1
        s.clock.advance(2.0)
        for i in range(n - 20, n):
            s.scheduler.on_first_token(f"slow{i}")
            s.scheduler.on_finished(f"slow{i}")
        s.clock.advance(1.0)
        s.scheduler.tick()


def test_a_budget_at_its_floor_says_which_signal_cut_it() -> None:
    s = Scenario()
    cut_to_the_floor(s)
    report = turn_body(s.admission)["engines"][0]
    budget = report["budget"]
    assert budget["state"] == "floor"
    why = budget["why"]
    assert why["signal"] == "ttft" and why["value_s"] == 2.0 and why["aim_s"] == 0.24
    iso(why["time"])
    words = sentence(report)
    assert f"budget {budget['tokens']:,} tokens, at its floor: cut for the time to first " in words
    assert "(p95 2,000 ms over its aim 240 ms, target 300 ms, 20 samples" in words
    assert "of budget" not in words


def test_a_falling_budget_says_so_and_a_slow_signal_is_tied_to_it() -> None:
    s = Scenario()
    s.submit("doc", BATCH, 100)
    for i in range(20):
        s.submit(f"chat-{i}", CHAT, 50)
    s.clock.advance(2.0)
    for i in range(20):
        s.scheduler.on_first_token(f"chat-{i}")
    s.clock.advance(1.0)
    s.scheduler.tick()  # one cut, 8,192 -> 4,096
    report = turn_body(s.admission)["engines"][0]
    assert report["budget"]["state"] == "falling"
    words = sentence(report)
    assert "budget 4,096 tokens, falling: cut for the time to first token" in words
    assert "time to first token p95 2,000 ms over its target 300 ms: the budget was cut" in words


def test_a_steady_budget_adds_nothing_to_the_sentence() -> None:
    s = Scenario()
    s.submit("doc", BATCH, 100)
    report = turn_body(s.admission)["engines"][0]
    assert report["budget"]["state"] == "steady" and report["budget"]["why"] is None
    assert "budget " not in sentence(report).split("—", 1)[1].replace("budget tokens", "")


def test_chat_over_the_budget_is_named_as_never_held_by_it() -> None:
    s = Scenario()
    s.submit("doc", BATCH, 6000)  # within the 8,192 budget
    s.submit("chat", CHAT, 4000)  # chat is never held by the budget: 10,000 in prefill
    words = sentence(turn_body(s.admission)["engines"][0])
    assert "10,000 tokens in prefill, over the 8,192 budget: chat is never held by it" in words
    assert "one prompt is always allowed" not in words
