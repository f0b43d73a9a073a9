"""Stalls and quiet gaps from a decode stream's token arrival times."""

from __future__ import annotations

import pytest

from loadtests.probe.timeline import (
    Quiet,
    long_gaps,
    quiet_gaps,
    stall,
    step_threshold,
    tokens_after,
)

# First token at 0 (after the stream's own prefill), then every 5 ms; one 100 ms
# step between 0.040 and 0.140 (the injected prompt, sent at 0.038, answered at 0.141).
ARRIVALS = [0.0, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.140, 0.145, 0.150]


def test_stall_is_the_longest_gap_overlapping_the_window() -> None:
    assert stall(ARRIVALS, 0.038, 0.141) == pytest.approx(0.100)


def test_a_step_that_began_before_the_prompt_was_sent_counts() -> None:
    # Sent at 0.041, just after the last quiet token: the step was already waiting.
    assert stall(ARRIVALS, 0.041, 0.139) == pytest.approx(0.100)


def test_gaps_outside_the_window_do_not_count() -> None:
    assert stall(ARRIVALS, 0.141, 0.146) == pytest.approx(0.005)
    assert stall(ARRIVALS, 0.016, 0.024) == pytest.approx(0.005)


def test_stall_needs_a_token_after_the_window_opened() -> None:
    with pytest.raises(ValueError, match="no decode token"):
        stall(ARRIVALS, 0.2, 0.3)
    with pytest.raises(ValueError, match="before it starts"):
        stall(ARRIVALS, 0.3, 0.2)


def test_quiet_gaps_skip_the_first_gap() -> None:
    quiet = quiet_gaps(ARRIVALS, 0.038)
    assert quiet.median_gap_s == pytest.approx(0.005)
    assert quiet.worst_gap_s == pytest.approx(0.005)  # not the 10 ms after the first token


def test_quiet_gaps_need_two_gaps() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        quiet_gaps(ARRIVALS, 0.012)


def test_tokens_after() -> None:
    assert tokens_after(ARRIVALS, 0.141) == 2
    assert tokens_after(ARRIVALS, 1.0) == 0


def test_step_threshold_stands_clear_of_quiet_jitter_and_hiccups() -> None:
    quiet = Quiet(median_gap_s=0.005, worst_gap_s=0.006)
    assert step_threshold(quiet, stall_s=0.020) == pytest.approx(0.010)
    jittery = Quiet(median_gap_s=0.005, worst_gap_s=0.009)
    assert step_threshold(jittery, stall_s=0.020) == pytest.approx(0.0135)
    # Beside 1.8 s steps, a 50 ms gap is a hiccup, not a step.
    assert step_threshold(quiet, stall_s=1.8) == pytest.approx(0.225)


def test_long_gaps_count_the_steps_of_a_chunked_prefill() -> None:
    # Quiet 5 ms steps, then three 60 ms steps with a chunk each, then quiet again.
    arrivals = [0.000, 0.005, 0.010, 0.070, 0.130, 0.190, 0.195, 0.200]
    assert long_gaps(arrivals, 0.011, 0.191, threshold=0.010) == 3
    assert long_gaps(arrivals, 0.131, 0.191, threshold=0.010) == 1
    assert long_gaps(ARRIVALS, 0.038, 0.141, threshold=0.010) == 1
