"""Calibration's reductions from token arrival times to measurements: the steady
decode gap, the step that computed a prefill, the median of repeats."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loadtests.probe.calibrate.token_times import (
    Kind,
    Measurement,
    WindowError,
    median_of,
    stall_step,
    steady_gap,
)


def test_steady_gap_reads_the_window_where_every_stream_decodes() -> None:
    # Stream a starts 3 steps before b; steps of 10 ms; both 12 tokens.
    a = [0.01 * i for i in range(12)]
    b = [0.03 + 0.01 * i for i in range(12)]
    gap, context = steady_gap([a, b], [100, 200], skip=2)
    assert gap == pytest.approx(0.01)
    # Window 0.05..0.11: a has tokens 5..11, b tokens 2..8; the context is read about
    # the middle of each (the hull edge there may be a token shorter than the window).
    assert context == pytest.approx(100 + (6 + 11) / 2 + 200 + (3 + 8) / 2, abs=1.0)


def test_steady_gap_counts_tokens_that_came_in_one_chunk() -> None:
    times = [0.0, 0.01, 0.02, 0.04, 0.04, 0.05, 0.06]  # tokens 3 and 4 arrived together
    gap, _ = steady_gap([times], [10], skip=1)
    assert gap == pytest.approx(0.01)


def test_steady_gap_reads_under_late_bursts() -> None:
    # 5 ms steps; the server stalls twice and then delivers what it held at once.
    on_time = [0.005 * j for j in range(40)]
    late = {j: 0.1001 + 0.00001 * j for j in range(8, 20)}
    late |= {j: 0.1801 + 0.00001 * j for j in range(26, 36)}
    times = [late.get(j, t) for j, t in enumerate(on_time)]
    gap, _ = steady_gap([times], [16], skip=4)
    assert gap == pytest.approx(0.005)


def test_steady_gap_needs_a_window() -> None:
    with pytest.raises(WindowError):
        steady_gap([[0.0, 0.01, 0.02], [0.5, 0.51, 0.52]], [1, 1], skip=0)
    with pytest.raises(WindowError):
        steady_gap([[0.0, 0.01]], [1], skip=2)


def test_stall_step_survives_late_tokens() -> None:
    # 10 ms steps; the step ending token 8 takes 50 ms; token 8 itself is seen 4 ms
    # late, token 5 comes 6 ms late.
    times = [0.01 * i for i in range(8)] + [0.07 + 0.05 + 0.004, 0.13, 0.14]
    times[5] += 0.006
    j, stall = stall_step(times, at=0.12)
    assert j == 8
    assert stall == pytest.approx(0.05)


def test_stall_step_needs_tokens_around_it_that_came_step_by_step() -> None:
    with pytest.raises(WindowError, match="near an end"):
        stall_step([0.0, 0.01, 0.02, 0.03], at=0.03)
    burst = [0.01 * i for i in range(6)] + [0.051, 0.0511, 0.0512, 0.0513]
    with pytest.raises(WindowError, match="burst"):
        stall_step(burst, at=0.0512)


def test_median_of_repeats() -> None:
    ms = [
        Measurement(kind=Kind.DECODE, seconds=s, batch=2, context_tokens=c)
        for s, c in ((0.3, 10), (0.1, 30), (0.2, 20))
    ]
    m = median_of(ms)
    assert (m.seconds, m.context_tokens, m.repeats) == (0.2, 20, 3)
    with pytest.raises(ValueError, match="shapes"):
        median_of([ms[0], replace(ms[1], batch=4)])
