"""Arrival processes: the rate and the burstiness they promise, over many seeded draws;
the same seed gives the same schedule; trace files are read and checked."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest

from loadtests.harness.arrivals import gamma_times, poisson_times, trace_times


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def test_poisson_rate_and_exponential_gaps() -> None:
    draws = [poisson_times(5.0, 200.0, seed) for seed in range(20)]
    rate = statistics.mean(len(t) / 200.0 for t in draws)
    assert rate == pytest.approx(5.0, rel=0.03)
    gaps = [g for t in draws for g in _gaps(t)]
    # exponential gaps: coefficient of variation 1
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_keeps_the_rate_and_clumps_by_its_burstiness(burstiness: float) -> None:
    draws = [gamma_times(4.0, burstiness, 250.0, seed) for seed in range(20)]
    rate = statistics.mean(len(t) / 250.0 for t in draws)
    assert rate == pytest.approx(4.0, rel=0.05)
    gaps = [g for t in draws for g in _gaps(t)]
    cv = statistics.stdev(gaps) / statistics.mean(gaps)
    assert cv == pytest.approx(burstiness**0.5, rel=0.1)


def test_same_seed_same_schedule_and_within_the_duration() -> None:
    a, b = poisson_times(3.0, 30.0, 7), poisson_times(3.0, 30.0, 7)
    assert a == b and a != poisson_times(3.0, 30.0, 8)
    assert all(0 <= t < 30.0 for t in a) and a == sorted(a)


def test_non_positive_rate_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        gamma_times(0.0, 1.0, 10.0, 0)


def test_trace_file_is_sorted_cut_and_commented(tmp_path: Path) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text("# seconds\n2.5\n0.5\n\n1.0  # a burst\n99\n")
    assert trace_times(trace, 10.0) == [0.5, 1.0, 2.5]


def test_trace_file_names_the_bad_line(tmp_path: Path) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text("0.5\nsoon\n")
    with pytest.raises(ValueError, match=r"trace.txt:2: not a time"):
        trace_times(trace, 10.0)
