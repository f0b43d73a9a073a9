"""Prefix pieces: the arithmetic of a plan, the piece size, and how the scheduler
admits the pieces of a long batch prompt (one at a time, pinned, after chat)."""

from __future__ import annotations

import pytest

from proxy.scheduler import HeldReason, Phase
from proxy.scheduler.pieces import (
    EnginePieces,
    Piece,
    PiecingMode,
    aligned,
    cache_held,
    next_piece,
    piece_size,
    plan,
)

from .helpers import B, I, check_accounting, check_turns, engine, job, make, sent

# -- the plan --------------------------------------------------------------------


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
    pieces = plan(total, size, block)
    assert [p.end for p in pieces] == ends
    assert [p.index for p in pieces] == list(range(1, len(ends) + 1))
    assert [p.final for p in pieces] == [False] * (len(ends) - 1) + [True]
    assert all(p.end % block == 0 for p in pieces[:-1])
    # each piece finds the one before it cached and computes only what is new
    assert [p.cached for p in pieces] == [0, *ends[:-1]]
    assert sum(p.new_tokens for p in pieces) == total
    assert 1 <= pieces[-1].new_tokens <= aligned(size, block)


def test_the_piece_after_a_given_point_and_bad_input() -> None:
    assert next_piece(5000, 1024, 512, 16, index=3) == Piece(3, 1536, 1024, final=False)
    assert next_piece(5000, 4608, 512, 16) == Piece(1, 5000, 4608, final=True)
    with pytest.raises(ValueError):
        next_piece(100, 100, 16, 16)
    with pytest.raises(ValueError):
        aligned(100, 0)


def test_piece_size_follows_the_cost_per_token_within_bounds() -> None:
    # 0.08 s at 0.2 ms a token: 400 tokens, in whole blocks of 16
    assert piece_size(0.0002, 0.08, 16, 256, 2048) == 400
    assert piece_size(0.0002, 0.07, 16, 256, 2048) == 336  # 350 rounded down
    assert piece_size(0.01, 0.08, 16, 256, 2048) == 256  # slow engine: the floor
    assert piece_size(0.000001, 0.08, 16, 256, 2048) == 2048  # fast engine: the cap
    assert piece_size(0.0, 0.08, 16, 256, 2048) == 2048


def test_cache_held_needs_the_earlier_pieces_reported_cached() -> None:
    assert cache_held(512, 512) and cache_held(512, 528) and cache_held(0, 0)
    assert not cache_held(512, 496)
    assert not cache_held(512, None)  # not reported: cannot be checked


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
    facts.observe(400, 0.04)  # 0.1 ms a token: 800 tokens fit in 0.08 s
    assert facts.piece_tokens == 800 and facts.pieces == 1
    # a piece that waited (for a chat, a decode step) does not shrink the next one:
    # every piece's time bounds the engine's cost from above, the least is kept
    facts.observe(400, 0.16)
    assert facts.seconds_per_token == pytest.approx(0.0001)
    for _ in range(4):  # ... until the engine is slower for a whole window
        facts.observe(400, 0.08)
    assert facts.seconds_per_token == pytest.approx(0.0002)
    assert facts.piece_tokens == 400
    # with no chat stream decoding there, a piece may take half the TTFT aim
    assert facts.piece_tokens_for(streams=False) == 592  # 0.12 / 0.0002 = 600 -> 592
    facts.disable("the cache did not hold")
    report = facts.report()
    assert report["enabled"] is False and report["fallbacks"] == 1
    assert report["reason"] == "the cache did not hold"
    assert report["prompt_token_cost_ms"] == pytest.approx(0.2)
    assert "--long-prefill-token-threshold" in str(report["advice"])


# -- the scheduler ------------------------------------------------------------------

BUDGET = {"initial_tokens": 8192, "min_tokens": 512, "max_tokens": 65536}


def test_a_pieced_prompt_goes_piece_by_piece_and_chat_goes_between() -> None:
    s, clock = make(engine("a", budget=BUDGET), engine("b", budget=BUDGET))
    first = job(B, 512, id="long")
    first.piece = 1
    s.submit(first)
    assert sent(s) == {"long": "a"}
    # a chat arrives while piece 1 is in prefill; it goes at once (to the idle engine
    # or this one, the scheduler's choice), and piece 2 is queued pinned to a
    clock.advance(0.05)
    s.submit(job(I, 40, id="chat"))
    chat_engine = sent(s)["chat"]
    assert s.next_piece("long", 512, pin=True)
    assert first.phase is Phase.QUEUED and first.pinned == "a" and first.piece == 2
    check_accounting(s, [first])
    if chat_engine == "a":
        assert sent(s) == {}  # the chat is in prefill on a: the piece steps aside
        assert first.held is HeldReason.INTERACTIVE_WAITING
        check_turns(s)
        s.on_first_token("chat")
    # pinned: it never goes to b, whatever b's load
    assert sent(s) == {"long": "a"}
    assert s.engines["a"].prefill_tokens(B) == 512  # a piece costs its new tokens
    assert s.next_piece("long", 300, pin=True)
    assert sent(s) == {"long": "a"}
    pieces = [d.piece for d in s.log if d.job_id == "long" and d.admitted]
    assert pieces == [1, 2, 3]
    s.on_first_token("long")
    assert s.on_finished("long") is first
    check_accounting(s, [first])
    assert not s.next_piece("long", 1, pin=True)  # gone: nothing to requeue


def test_one_piece_at_a_time_per_engine() -> None:
    s, _ = make(engine("a", budget=BUDGET))
    one, two = job(B, 512, id="one"), job(B, 512, id="two")
    one.piece = two.piece = 1
    s.submit(one)
    s.submit(two)
    whole = job(B, 100, id="short")  # a short prompt, not pieced, still fits the budget
    s.submit(whole)
    assert sent(s) == {"one": "a"}  # two held (short waits its turn behind it)
    assert two.held is HeldReason.PREFILL_BUDGET
    check_turns(s)
    s.next_piece("one", 512, pin=True)
    # one's next piece is back at the head of the queue: it goes first again
    assert sent(s) == {"one": "a"}
    s.on_first_token("one")  # one's final request is decoding: two may start
    assert sent(s) == {"two": "a", "short": "a"}


def test_a_failed_final_request_is_unpinned_for_another_engine() -> None:
    s, _ = make(engine("a", budget=BUDGET), engine("b", budget=BUDGET))
    j = job(B, 512, id="long")
    j.piece = 1
    s.submit(j)
    assert sent(s) == {"long": "a"}
    s.next_piece("long", 200, pin=True)
    assert sent(s) == {"long": "a"}
    assert s.on_failed("long", retry=True)  # a's cache is lost with it
    assert j.pinned is None
    assert sent(s) == {"long": "b"}


def test_a_prompt_whose_cache_did_not_hold_goes_whole_anywhere() -> None:
    s, _ = make(engine("a", budget=BUDGET), engine("b", budget=BUDGET))
    j = job(B, 512, id="long")
    j.piece = 1
    s.submit(j)
    sent(s)
    s.next_piece("long", 6000, pin=False)
    assert j.pinned is None and j.prompt_tokens == 6000
    assert set(sent(s).values()) <= {"a", "b"}
    check_accounting(s, [j])
