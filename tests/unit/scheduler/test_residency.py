"""Which model is awake on a card: chat wakes ahead of batch, batch waits for a quiet
window or its deadline, nothing in flight is cut, and two models do not thrash."""

from __future__ import annotations

from proxy.scheduler.residency import Card, Demand, Move, ResidencyRules, decide

RULES = ResidencyRules(min_awake_s=60.0, chat_quiet_s=30.0, deadline_slack_s=300.0)


def card(awake: str | None = "a", since: float = 0.0, in_flight: int = 0) -> Card:
    return Card("card0", ("a", "b"), awake, since, in_flight, wake_s={"a": 20.0, "b": 20.0})


def test_chat_for_a_sleeping_model_drains_the_awake_one_then_swaps() -> None:
    chat_b = {"b": Demand(chat_waiting=1, chat_oldest=100.0, last_chat=100.0)}
    busy = decide(card(in_flight=3), chat_b, 101.0, RULES)
    assert busy.move is Move.DRAIN and busy.target == "b"  # nothing in flight is cut
    idle = decide(card(in_flight=0), chat_b, 102.0, RULES)
    assert idle.move is Move.SWAP and idle.target == "b"
    assert "chat waiting for b" in idle.reason


def test_chat_wakes_ahead_of_the_awake_models_batch() -> None:
    demand = {
        "a": Demand(batch_waiting=500, batch_work_s=3000.0),
        "b": Demand(chat_waiting=1, chat_oldest=10.0, last_chat=10.0),
    }
    assert decide(card(since=0.0), demand, 11.0, RULES).move is Move.SWAP


def test_two_live_chat_models_take_turns_no_faster_than_the_minimum() -> None:
    demand = {
        "a": Demand(chat_waiting=1, chat_oldest=50.0, chat_in_flight=2, last_chat=50.0),
        "b": Demand(chat_waiting=1, chat_oldest=20.0, last_chat=20.0),
    }
    young = decide(card(since=10.0, in_flight=2), demand, 50.0, RULES)
    assert young.move is Move.STAY and "woke 40 s ago" in young.reason
    due = decide(card(since=10.0, in_flight=2), demand, 71.0, RULES)
    assert due.move is Move.DRAIN and due.target == "b"  # b's chat waited longer
    newer = {**demand, "a": Demand(chat_waiting=1, chat_oldest=5.0, last_chat=50.0)}
    assert decide(card(since=10.0), newer, 71.0, RULES).move is Move.STAY


def test_batch_for_a_sleeping_model_waits_for_a_quiet_window() -> None:
    batch_b = Demand(batch_waiting=100, batch_work_s=600.0)
    live = {"a": Demand(chat_in_flight=1, last_chat=500.0), "b": batch_b}
    assert decide(card(), live, 500.0, RULES).move is Move.STAY
    lull = {"a": Demand(last_chat=500.0), "b": batch_b}
    paused = decide(card(), lull, 520.0, RULES)  # a pause between two chats is no window
    assert paused.move is Move.STAY and "seen 20 s ago" in paused.reason
    # the two wakes of a swap there and back (20 + 20 s) outlast chat_quiet_s (30 s)
    wakes = decide(card(), lull, 531.0, RULES)
    assert wakes.move is Move.STAY and "waits 40 s" in wakes.reason
    window = decide(card(), lull, 541.0, RULES)
    assert window.move is Move.SWAP and window.target == "b"
    quick = Card("card0", ("a", "b"), "a", 0.0, wake_s={"a": 2.0, "b": 3.0})
    assert decide(quick, lull, 531.0, RULES).move is Move.SWAP  # chat_quiet_s rules


def test_a_slow_wake_makes_batch_wait_for_a_longer_quiet() -> None:
    """Ski rental: a swap for batch costs chat that returns both wakes, so the quiet
    waited for grows with them (here 90 s wakes, the 30 s setting overruled)."""
    slow = Card("card0", ("a", "b"), "a", 0.0, wake_s={"a": 90.0, "b": 90.0})
    lull = {"a": Demand(last_chat=500.0), "b": Demand(batch_waiting=10, batch_work_s=60.0)}
    assert decide(slow, lull, 679.0, RULES).move is Move.STAY
    assert decide(slow, lull, 681.0, RULES).move is Move.SWAP


def test_batch_does_not_take_a_model_woken_lately_or_busy_with_its_own_batch() -> None:
    batch_b = Demand(batch_waiting=100, batch_work_s=600.0)
    assert decide(card(since=1000.0), {"b": batch_b}, 1030.0, RULES).move is Move.STAY
    own = {"a": Demand(batch_waiting=5), "b": batch_b}
    assert decide(card(since=0.0), own, 1030.0, RULES).move is Move.STAY


def test_a_batch_deadline_takes_the_card_even_from_live_chat() -> None:
    live = Demand(chat_waiting=2, chat_oldest=9000.0, chat_in_flight=4, last_chat=9000.0)
    # 600 s of work + 20 s to wake + 300 s slack: pressed from 10,000 - 920 = 9,080 s
    batch_b = Demand(batch_waiting=100, batch_work_s=600.0, batch_deadline=10_000.0)
    early = decide(card(since=8000.0, in_flight=4), {"a": live, "b": batch_b}, 9000.0, RULES)
    assert early.move is Move.STAY
    late = decide(card(since=8000.0, in_flight=4), {"a": live, "b": batch_b}, 9080.0, RULES)
    assert late.move is Move.DRAIN and "deadline" in late.reason


def test_an_empty_card_wakes_chat_first_and_a_swapping_one_decides_nothing() -> None:
    demand = {
        "a": Demand(batch_waiting=9, batch_deadline=50.0),
        "b": Demand(chat_waiting=1, chat_oldest=3.0),
    }
    assert decide(card(awake=None), demand, 5.0, RULES).target == "b"
    assert decide(card(awake=None), {"a": demand["a"]}, 5.0, RULES).target == "a"
    assert decide(card(awake=None), {}, 5.0, RULES).move is Move.STAY
    swapping = card()
    swapping.swapping = "b"
    assert decide(swapping, demand, 5.0, RULES).move is Move.STAY


def test_chat_on_two_models_arriving_in_turn_swaps_at_most_once_a_minimum() -> None:
    """A chat for a and one for b every second, for ten minutes, each answered in 2 s
    once its model is awake; waking takes 20 s. Whoever asks next does not decide:
    the card swaps no more often than once per ``min_awake_s`` (plus a wake)."""
    c = card(since=0.0)
    waiting: dict[str, list[float]] = {"a": [], "b": []}
    running: list[tuple[float, str]] = []  # (ends at, model)
    swaps, t, woke_at = 0, 0.0, 0.0
    while t < 600.0:
        for model in ("a", "b"):
            waiting[model].append(t)
        running = [(end, m) for end, m in running if end > t]
        if c.swapping is not None and t >= woke_at:
            c.awake, c.awake_since, c.swapping = c.swapping, t, None
        if c.swapping is None and c.awake is not None:
            move = decide(c, _demand(waiting, running, c.awake, t), t, RULES)
            if move.move is Move.SWAP:
                assert not running, "a swap never cuts work in flight"
                swaps += 1
                c.swapping, woke_at = move.target, t + 20.0
            elif move.move is Move.STAY:
                running += [(t + 2.0, c.awake) for _ in waiting[c.awake]]
                waiting[c.awake].clear()
        c.in_flight = len(running)
        t += 1.0
    assert 2 <= swaps <= 600.0 / (RULES.min_awake_s + 20.0) + 1


def _demand(
    waiting: dict[str, list[float]], running: list[tuple[float, str]], awake: str, now: float
) -> dict[str, Demand]:
    out = {}
    for model, queued in waiting.items():
        in_flight = sum(1 for _, m in running if m == model)
        out[model] = Demand(
            chat_waiting=len(queued),
            chat_oldest=queued[0] if queued else None,
            chat_in_flight=in_flight,
            last_chat=now if queued or in_flight else None,
        )
    return out


def test_a_model_woken_for_its_deadline_keeps_the_card_until_it_is_ahead_again() -> None:
    chat_a = Demand(chat_waiting=3, chat_oldest=9000.0, last_chat=9000.0)
    # b awake for its deadline: 600 s of work left, due at 10,000, slack 300 + 60
    pressed = Demand(batch_waiting=100, batch_work_s=600.0, batch_deadline=10_000.0)
    held = decide(card(awake="b", since=9000.0), {"a": chat_a, "b": pressed}, 9100.0, RULES)
    assert held.move is Move.STAY and "deadline" in held.reason
    ahead = Demand(batch_waiting=10, batch_work_s=60.0, batch_deadline=10_000.0)
    back = decide(card(awake="b", since=9000.0), {"a": chat_a, "b": ahead}, 9100.0, RULES)
    assert back.move is Move.SWAP and back.target == "a"
