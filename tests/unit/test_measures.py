"""The harness's arithmetic on hand-computed streams: TTFT, ITL, TPOT, percentiles,
valid records per hour, and the answer check between arms."""

from __future__ import annotations

import math

import pytest

from loadtests.harness.client import Record
from loadtests.harness.measures import answer_mismatches, gaps, pct, summarize, tpot, valid_per_hour


def _record(
    id: str,
    sent: float,
    tokens: list[float],
    finished: float,
    *,
    text: str = "",
    queue_ms: float | None = None,
) -> Record:
    return Record(
        id=id,
        kind="new",
        url="u",
        prompt_tokens_sent=0,
        max_tokens=len(tokens),
        sent_at=sent,
        token_times=tokens,
        finished_at=finished,
        status=200,
        finish_reason="length",
        completion_tokens=len(tokens),
        proxy_queue_ms=queue_ms,
        text=text,
    )


def test_ttft_itl_and_tpot_of_one_stream() -> None:
    # sent at 10.0; tokens at 10.5, 10.6, 10.8, 11.1; last byte at 11.1
    r = _record("a", 10.0, [10.5, 10.6, 10.8, 11.1], 11.1)
    assert r.ttft == pytest.approx(0.5)
    assert gaps(r) == pytest.approx([0.1, 0.2, 0.3])
    # (E2E - TTFT) / (n - 1) = (1.1 - 0.5) / 3 = 0.2
    assert tpot(r) == pytest.approx(0.2)


def test_tpot_needs_two_tokens() -> None:
    assert tpot(_record("a", 0.0, [0.4], 0.4)) is None


@pytest.mark.parametrize(
    ("q", "expected"),
    [(0.5, 5.0), (0.95, 10.0), (0.9, 9.0), (0.1, 1.0), (0.99, 10.0)],
)
def test_nearest_rank_percentiles(q: float, expected: float) -> None:
    values = [float(v) for v in (7, 3, 10, 1, 5, 9, 2, 8, 4, 6)]
    assert pct(values, q) == expected


def test_percentile_of_nothing_is_nan() -> None:
    assert math.isnan(pct([], 0.95))


def test_valid_per_hour_counts_whole_answers_finished_in_the_window() -> None:
    inside = [_record(f"in{i}", 0.0, [1.0, 2.0], 2.0 + i) for i in range(3)]  # 2, 3, 4
    late = _record("late", 0.0, [1.0, 2.0], 20.0)
    short = _record("short", 0.0, [1.0, 2.0], 3.0)
    short.completion_tokens = 1  # not a whole answer
    # 3 valid in a 10 s window: 1,080 per hour
    assert valid_per_hour([*inside, late, short], 0.0, 10.0) == pytest.approx(1080.0)


def test_summary_uses_requests_sent_in_the_window() -> None:
    early = _record("early", 1.0, [9.0, 9.1], 9.1)  # before the window: not counted
    a = _record("a", 5.0, [5.2, 5.3], 5.3, queue_ms=20.0)
    b = _record("b", 6.0, [6.4, 6.5], 6.5, queue_ms=40.0)
    s = summarize([early, a, b], 4.0, 10.0)
    assert s.requests == 2 and s.valid == 2
    assert s.ttft_p50 == pytest.approx(0.2)
    assert s.ttft_p95 == pytest.approx(0.4)
    assert s.queue_p95 == pytest.approx(0.04)
    # throughput counts what finished in the window, the early one too
    assert s.valid_per_hour == pytest.approx(3 * 3600 / 6)


def test_answer_check_counts_differing_answers_of_whole_pairs() -> None:
    direct = [
        _record("1", 0, [1, 2], 2, text="the of"),
        _record("2", 0, [1, 2], 2, text="and to"),
        _record("3", 0, [1, 2], 2, text="x"),
    ]
    proxy = [
        _record("1", 0, [1, 2], 2, text="the of"),
        _record("2", 0, [1, 2], 2, text="and in"),
        _record("4", 0, [1, 2], 2, text="x"),  # no partner
    ]
    assert answer_mismatches(direct, proxy) == (2, 1)


def test_answer_check_leaves_out_streams_closed_early() -> None:
    a = _record("1", 0, [1, 2], 2, text="the")
    b = _record("1", 0, [1, 2], 2, text="the of")
    b.closed_at = 2.0
    assert answer_mismatches([a], [b]) == (0, 0)
