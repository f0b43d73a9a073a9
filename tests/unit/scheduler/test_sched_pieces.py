"""Prefix pieces: the arithmetic of a plan, the piece size, and how the scheduler
admits the pieces of a long batch prompt (one at a time, pinned, after chat)."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.config import BudgetConfig
from proxy.scheduler import HeldReason, Job, pieces
from proxy.scheduler.pieces import (
    CHUNK_PROBES,
    ChatSigns,
    Choice,
    Chunking,
    EnginePieces,
    Piece,
    PiecingMode,
)

from .helpers import B, I, check_accounting, check_turns, engine, job, make, sent, submit

# -- the plan --------------------------------------------------------------------


def plan(total: int, size: int, block: int) -> list[Piece]:
    """Every piece of a ``total``-token prompt at a fixed ``size`` (the final last)."""
    made = [pieces.next_piece(total, 0, size, block)]
    while not made[-1].final:
        last = made[-1]
        made.append(pieces.next_piece(total, last.end, size, block, last.index + 1))
    return made


@pytest.mark.parametrize(
    ("total", "size", "block", "ends"),
    [
        (2000, 512, 16, [512, 1024, 1536, 2000]),
        (2000, 500, 16, [496, 992, 1488, 1984, 2000]),  # rounded down to whole blocks
        (1024, 512, 16, [512, 1024]),  # a whole number of pieces: the final has 512 new
        (1025, 512, 16, [512, 1024, 1025]),  # the final has one new token
        (300, 512, 16, [300]),  # shorter than one piece: sent whole
        (512, 512, 16, [512]),  # exactly one piece: sent whole
        (100, 10, 16, [16, 32, 48, 64, 80, 96, 100]),  # a piece is at least one block
    ],
)
def test_a_plan_covers_the_prompt_in_block_aligned_prefixes(
    total: int, size: int, block: int, ends: list[int]
) -> None:
    planned = plan(total, size, block)
    assert [p.end for p in planned] == ends
    assert [p.index for p in planned] == list(range(1, len(ends) + 1))
    assert [p.final for p in planned] == [False] * (len(ends) - 1) + [True]
    assert all(p.end % block == 0 for p in planned[:-1])
    # each piece finds the one before it cached and computes only what is new
    assert [p.cached for p in planned] == [0, *ends[:-1]]
    assert sum(p.new_tokens for p in planned) == total
    assert 1 <= planned[-1].new_tokens <= pieces.aligned(size, block)


def test_the_piece_after_a_given_point_and_bad_input() -> None:
    assert pieces.next_piece(5000, 1024, 512, 16, index=3) == Piece(3, 1536, 1024, final=False)
    assert pieces.next_piece(5000, 4608, 512, 16) == Piece(1, 5000, 4608, final=True)
    with pytest.raises(ValueError):
        pieces.next_piece(100, 100, 16, 16)
    with pytest.raises(ValueError):
        pieces.aligned(100, 0)


def test_piece_size_follows_the_cost_per_token_within_bounds() -> None:
    # 0.08 s at 0.2 ms a token: 400 tokens, in whole blocks of 16
    assert pieces.piece_size(0.0002, 0.08, 16, 256, 2048) == 400
    assert pieces.piece_size(0.0002, 0.07, 16, 256, 2048) == 336  # 350 rounded down
    assert pieces.piece_size(0.01, 0.08, 16, 256, 2048) == 256  # slow engine: the floor
    assert pieces.piece_size(0.000001, 0.08, 16, 256, 2048) == 2048  # fast engine: the cap
    assert pieces.piece_size(0.0, 0.08, 16, 256, 2048) == 2048


def test_cache_held_needs_the_earlier_pieces_reported_cached() -> None:
    assert pieces.cache_held(512, 512) and pieces.cache_held(512, 528) and pieces.cache_held(0, 0)
    assert not pieces.cache_held(512, 496)
    assert not pieces.cache_held(512, None)  # not reported: cannot be checked


def test_hits_held_needs_the_counter_to_rise_by_the_earlier_pieces() -> None:
    assert pieces.hits_held(512, 1000.0, 1512.0) is True
    assert pieces.hits_held(512, 1000.0, 2000.0) is True  # other requests' hits add
    assert pieces.hits_held(512, 1000.0, 1496.0) is False
    assert pieces.hits_held(0, 1000.0, 1000.0) is True
    assert pieces.hits_held(512, None, 1512.0) is None  # no counter: cannot tell
    assert pieces.hits_held(512, 1000.0, None) is None
    assert pieces.hits_held(512, 1000.0, 10.0) is None  # it went back: the engine restarted


# -- what the proxy knows per engine --------------------------------------------------


def test_auto_pieces_only_where_the_engine_reports_prefix_caching() -> None:
    cases = [
        (PiecingMode.AUTO, True, True),
        (PiecingMode.AUTO, None, False),
        (PiecingMode.AUTO, False, False),
        (PiecingMode.ON, None, True),
        (PiecingMode.ON, False, False),
        (PiecingMode.OFF, True, False),
    ]
    for mode, caching, enabled in cases:
        facts = EnginePieces(mode=mode)
        facts.discovered(caching, 32)
        assert facts.enabled is enabled, (mode, caching)
        assert facts.block_size == 32 and facts.reason


def test_the_piece_size_adapts_to_the_measured_cost_and_a_miss_turns_piecing_off() -> None:
    facts = EnginePieces(mode=PiecingMode.ON, initial_tokens=500, target_s=0.08, window=4)
    facts.discovered(True, 16)
    assert facts.piece_tokens == 496 and facts.seconds_per_token is None
    # 0.1 ms a token: a piece must fit in the gap aim (0.08 s) while chat streams
    # decode there, two in the TTFT aim (0.24 s): 800 tokens; 1,200 with no stream
    facts.answered(400, sent=0.0, now=0.04)
    assert facts.piece_tokens == 800 and facts.pieces == 1
    assert facts.piece_tokens_for(streams=False) == 1200
    # a piece sent while the one before it ran: the engine's time for it starts
    # with that one's answer, not with its own send
    facts.answered(400, sent=0.01, now=0.08)
    assert facts.seconds_per_token == pytest.approx(0.0001)
    # two pieces answered together (one step, or the first read late): the second
    # looks free on its own, and the sum over both is still the engine's time
    facts.answered(400, sent=0.085, now=0.165)
    facts.answered(400, sent=0.09, now=0.1655)
    assert facts.seconds_per_token == pytest.approx(0.1605 / 1600) and facts.pieces == 4
    # a piece that waited (for a chat, a decode step) raises the cost: smaller
    # pieces, never larger (window 4: the first piece's sample is gone)
    facts.answered(400, sent=0.3, now=0.46)
    assert facts.seconds_per_token == pytest.approx((0.04 + 0.08 + 0.0005 + 0.16) / 1600)
    now = 0.5
    for _ in range(4):  # an engine slower for a whole window
        facts.answered(400, sent=now, now=now + 0.08)
        now += 0.1
    assert facts.seconds_per_token == pytest.approx(0.0002)
    assert facts.piece_tokens == 400  # 0.08 / 0.0002
    # with no chat stream decoding there, the two pieces may take the TTFT aim
    assert facts.piece_tokens_for(streams=False) == 592  # 0.12 / 0.0002 = 600 -> 592
    facts.disable("the cache did not hold")
    report = facts.report()
    assert report["enabled"] is False and report["fallbacks"] == 1
    assert report["reason"] == "the cache did not hold"
    assert report["prompt_token_cost_ms"] == pytest.approx(0.2)


def test_the_floor_is_whole_blocks_of_the_engine_not_a_fixed_size() -> None:
    facts = EnginePieces(mode=PiecingMode.ON, target_s=0.08, idle_target_s=0.24)
    facts.discovered(True, 128)
    facts.answered(100, sent=0.0, now=0.2)  # 2 ms a token: a slow engine
    assert facts.min_tokens == 128
    assert facts.piece_tokens == 128  # 40 tokens would fit the aim: one block of 128
    facts.discovered(True, 16)
    assert facts.piece_tokens == 64  # the floor follows the block: four of 16
    facts.discovered(True, 48)
    assert facts.piece_tokens == 96


# -- the scheduler ------------------------------------------------------------------

BUDGET = {"initial_tokens": 8192, "min_tokens": 512, "max_tokens": 65536}
BUDGET_INTERVAL_S = BudgetConfig().interval_s


def piece(tokens: int, index: int, *, prompt: str = "p", pinned: str | None = None) -> Job:
    j = job(B, tokens, id=f"{prompt}#{index}")
    j.piece, j.pinned = index, pinned
    return j


def test_pieces_are_pinned_and_chat_goes_between_them() -> None:
    s, _ = make(engine("a", budget=BUDGET), engine("b", budget=BUDGET))
    s.submit(piece(512, 1))
    assert sent(s) == {"p#1": "a"}
    s.submit(piece(512, 2, pinned="a"))
    assert sent(s) == {"p#2": "a"}  # pinned: never to the idle b
    assert s.engines["a"].prefill_tokens(B) == 1024  # each costs its new tokens
    # a chat arrives and goes to a (its least predicted wait is b's, so pin it to a
    # by taking b out): the next piece steps aside while it is in prefill
    s.set_engine_up("b", False)
    s.submit(job(I, 40, id="chat"))
    assert sent(s) == {"chat": "a"}
    s.on_finished("p#1")
    third = piece(512, 3, pinned="a")
    s.submit(third)
    assert sent(s) == {}
    assert third.held is HeldReason.INTERACTIVE_WAITING
    check_turns(s)
    s.on_first_token("chat")
    assert sent(s) == {"p#3": "a"}
    log = [(d.job_id, d.piece) for d in s.log if d.admitted]
    assert log == [("p#1", 1), ("p#2", 2), ("chat", 0), ("p#3", 3)]
    check_accounting(s, [third])


def test_at_most_two_pieces_in_prefill_per_engine() -> None:
    s, _ = make(engine("a", budget=BUDGET))
    for j in (piece(512, 1, prompt="x"), piece(512, 1, prompt="y"), piece(512, 1, prompt="z")):
        s.submit(j)
    short = job(B, 100, id="short")  # not pieced: waits its turn behind them
    s.submit(short)
    assert sent(s) == {"x#1": "a", "y#1": "a"}
    assert s.jobs["z#1"].held is HeldReason.PREFILL_BUDGET
    check_turns(s)
    s.on_first_token("x#1")  # a final request decoding is no longer a piece in prefill
    assert sent(s) == {"z#1": "a", "short": "a"}
    check_accounting(s)


def test_a_failed_pinned_request_is_unpinned_for_another_engine() -> None:
    s, _ = make(engine("a", budget=BUDGET), engine("b", budget=BUDGET))
    final = piece(200, 4, prompt="long", pinned="a")
    s.submit(final)
    assert sent(s) == {"long#4": "a"}
    assert s.on_failed("long#4", retry=True)  # a's cache is lost with it
    assert final.pinned is None
    assert sent(s) == {"long#4": "b"}


def auto_facts(**fields: Any) -> EnginePieces:
    facts = EnginePieces(mode=PiecingMode.AUTO, need_s=120.0, **fields)
    facts.discovered(True, 16)
    return facts


@pytest.mark.parametrize(
    ("signs", "in_pieces", "why"),
    [
        (ChatSigns(), False, "batch only: no chat here yet"),
        (ChatSigns(streams=1), True, "chat live: 1 stream(s) in decode"),
        (ChatSigns(in_prefill=2), True, "chat live: 2 chat(s) in prefill"),
        (ChatSigns(queued=3), True, "chat live: 3 chat(s) queued"),
        (ChatSigns(last_at=990.0), True, "chat expected: a chat was sent here 10.0 s ago"),
        (ChatSigns(last_at=879.0), False, "batch only: no chat here for 121 s"),
        (ChatSigns(missed_at=900.0), True, "chat missed its aim beside batch prefill 100.0 s ago"),
        (ChatSigns(missed_at=870.0), False, "batch only: no chat here yet"),
    ],
)
def test_auto_decides_ahead_from_what_is_known_of_chat(
    signs: ChatSigns, in_pieces: bool, why: str
) -> None:
    assert auto_facts().choose(1000.0, signs) == Choice(in_pieces, why)


def test_on_off_and_an_engine_that_may_not_piece() -> None:
    live = ChatSigns(streams=4)
    on = EnginePieces(mode=PiecingMode.ON)
    assert on.choose(0.0, live).pieces is False  # not discovered yet
    on.discovered(None, 16)
    assert on.choose(0.0, ChatSigns()) == Choice(True, "piecing: on in the configuration")
    off = EnginePieces(mode=PiecingMode.OFF)
    off.discovered(True, 16)
    assert off.choose(0.0, live) == Choice(False, "piecing: off in the configuration")
    facts = auto_facts()
    facts.disable("the cache did not hold")
    assert facts.choose(0.0, live) == Choice(False, "the cache did not hold")


def test_an_engine_that_chunks_itself_gets_whole_prompts_misses_or_not() -> None:
    facts = auto_facts()
    assert facts.depth == 1  # the first piece runs alone: it judges the engine
    facts.judged(Chunking(True, "a 512-token piece of 400 ms stalled a chat stream for 200 ms"))
    assert facts.depth == 2 and facts.chunks_itself is True
    live = ChatSigns(streams=1)
    choice = facts.choose(1000.0, live)
    assert not choice.pieces and choice.why.startswith("the engine chunks itself: a 512-token")
    missed = facts.choose(1000.0, ChatSigns(streams=1, missed_at=999.0))
    assert missed == choice  # a miss there is the budget loop's to answer
    facts.judged(Chunking(False, "later"))  # judged once: a later piece changes nothing
    assert facts.chunks_itself is True


@pytest.mark.parametrize(
    ("index", "checks", "due"),
    [(1, 0, False), (2, 0, True), (3, 0, True), (3, 3, False), (2, 9, True), (8, 9, True),
     (9, 9, False), (16, 9, True)],
)  # fmt: skip
def test_the_hit_counter_checks_some_pieces_of_each_prompt(
    index: int, checks: int, due: bool
) -> None:
    assert pieces.hits_check_due(index, checks) is due


def test_pieces_that_cannot_tell_leave_the_chunking_unknown_then_pieces_go_two_at_a_time() -> None:
    facts = auto_facts()
    for _ in range(CHUNK_PROBES - 1):
        facts.judged(None)
        assert facts.chunks_itself is None and facts.depth == 1
    facts.judged(None)
    assert facts.chunks_itself is False and facts.depth == 2
    assert facts.choose(0.0, ChatSigns(streams=1)).pieces


@pytest.mark.parametrize(
    ("piece_s", "widest_s", "chunks"),
    [
        (0.400, 0.390, False),  # the stream waited for the whole piece: one step
        (0.400, 0.310, False),  # over 0.75 of it: a step and some decode
        (0.400, 0.210, True),  # about half: two steps (a threshold of 256 tokens)
        (0.400, 0.110, True),  # a quarter: four
        (0.400, 0.270, None),  # between the bounds: the next piece asks again
        (0.400, None, None),  # no stream ended a gap meanwhile
        (0.010, 0.002, None),  # too quick to tell from the decode steps
    ],
)
def test_a_stream_s_widest_gap_beside_a_lone_piece_tells_the_engine_s_chunking(
    piece_s: float, widest_s: float | None, chunks: bool | None
) -> None:
    verdict = pieces.judge_chunking(512, piece_s, widest_s)
    assert (None if verdict is None else verdict.chunks) == chunks
    if verdict is not None:
        assert verdict.why.startswith(f"a 512-token piece of {piece_s * 1000:.0f} ms stalled")


# -- the trigger, driven through the scheduler -----------------------------------------


def test_an_engine_that_serves_only_batch_through_many_budget_loop_runs_never_pieces() -> None:
    s, clock = make(engine("a", budget=BUDGET))
    facts = auto_facts()
    for n in range(200):  # a closed loop of batch prompts, the budget loop running
        j = submit(s, B, 3000, id=f"b{n}")
        assert sent(s) == {j.id: "a"}
        clock.advance(0.4)
        s.on_first_token(j.id)
        s.on_token_gap(j.id, 0.02)
        clock.advance(0.2)
        s.on_finished(j.id)
        s.tick()
        choice = facts.choose(clock.now(), s.chat_signs("a"))
        assert not choice.pieces, (n, choice)
    assert s.engines["a"].budget.missed_at is None
    assert clock.now() > 10 * BUDGET_INTERVAL_S


def test_the_first_chat_turns_piecing_on_for_what_is_not_sent_yet() -> None:
    s, clock = make(engine("a", budget=BUDGET), engine("b", "other", budget=BUDGET))
    facts = auto_facts()
    assert not facts.choose(clock.now(), s.chat_signs("a")).pieces
    chat = submit(s, I, 50, id="chat")
    assert facts.choose(clock.now(), s.chat_signs("a")).why == "chat live: 1 chat(s) queued"
    assert not facts.choose(clock.now(), s.chat_signs("b")).pieces  # not its model
    assert sent(s) == {"chat": "a"}
    assert facts.choose(clock.now(), s.chat_signs("a")).why == "chat live: 1 chat(s) in prefill"
    s.on_first_token(chat.id)
    assert facts.choose(clock.now(), s.chat_signs("a")).why == "chat live: 1 stream(s) in decode"
    clock.advance(30.0)
    s.on_finished(chat.id)
    clock.advance(60.0)
    expected = facts.choose(clock.now(), s.chat_signs("a"))
    assert expected == Choice(True, "chat expected: a chat was sent here 90.0 s ago")
    clock.advance(31.0)
    assert facts.choose(clock.now(), s.chat_signs("a")) == Choice(
        False, "batch only: no chat here for 121 s"
    )


def test_one_piece_at_a_time_while_the_engine_s_chunking_is_judged() -> None:
    s, _ = make(engine("a", budget=BUDGET))
    s.set_piece_depth("a", 1)
    for j in (piece(512, 1, prompt="x"), piece(512, 1, prompt="y")):
        s.submit(j)
    assert sent(s) == {"x#1": "a"}
    assert s.jobs["y#1"].held is HeldReason.PREFILL_BUDGET
    s.set_piece_depth("a", 2)
    assert sent(s) == {"y#1": "a"}
    check_accounting(s)


@pytest.mark.parametrize(
    ("now", "last_sent", "others", "piece_s", "wait"),
    [
        (10.0, 9.99, 0, 0.1, 0.0),  # no other piece in flight: at once
        (10.0, None, 1, 0.1, 0.0),  # nothing sent yet
        (10.0, 9.99, 1, None, 0.0),  # the cost is not known yet
        (10.0, 9.99, 1, 0.1, 0.04),  # half a piece after the last one was sent
        (10.0, 9.9, 1, 0.1, 0.0),  # that long ago already
    ],
)
def test_pieces_are_paced_one_a_step(
    now: float, last_sent: float | None, others: int, piece_s: float | None, wait: float
) -> None:
    assert pieces.pace_s(now, last_sent, others, piece_s) == pytest.approx(wait)
