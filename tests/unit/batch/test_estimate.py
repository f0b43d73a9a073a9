"""The estimate's arithmetic on cases computed by hand."""

from __future__ import annotations

from proxy.batch.estimate import Estimate, Throughput


def test_a_job_with_enough_records_uses_its_own_rate() -> None:
    t = Throughput(span_s=300)
    t.begin("batch_a", "m", 1000.0)
    for i in range(10):  # one record a second, every other one usable
        t.add(1000.0 + i, "batch_a", "m", usable=i % 2 == 0)
    # 10 records over the 10 s since the job began: 1/s, 0.5 usable/s; 90 left.
    assert t.estimate("batch_a", 90, 1100, now=1010.0) == Estimate(1100, 3600.0, 1800.0, True)
    assert t.estimate("batch_a", 90, 1099, now=1010.0).window_reachable is False


def test_the_span_slides() -> None:
    t = Throughput(span_s=60)
    t.begin("batch_a", "m", 0.0)
    for s in range(100):  # 3 a second for 100 s
        for _ in range(3):
            t.add(s + 0.5, "batch_a", "m", usable=True)
    t.add(130.5, "batch_a", "m", usable=True)  # then a trickle: 9 in the last minute
    for s in range(131, 139):
        t.add(s + 0.5, "batch_a", "m", usable=True)
    # At 140 the span holds seconds 81..139: 19 s of 3 (57) + 9 = 66 records in 60 s.
    assert t.rates("batch_a", 140.0) == (66 / 60, 66 / 60)


def test_a_new_job_shares_its_models_rate_and_says_at_once_it_is_late() -> None:
    t = Throughput(span_s=300)
    t.begin("batch_a", "m", 0.0)
    for s in range(1, 301):
        t.add(s + 0.5, "batch_a", "m", usable=True)
        t.add(s + 0.5, "batch_a", "m", usable=False)
    t.begin("batch_b", "m", 300.0)
    # The model did 600 records in 300 s (2/s), now shared by two jobs: 1/s for b.
    late = t.estimate("batch_b", 7200, expires_at=3900, now=300.0)
    assert late == Estimate(7500, 3600.0, 1800.0, False)
    t.end("batch_a")
    # Alone on the model: 2/s, 7,200 lines in 3,600 s, just within its window.
    assert t.estimate("batch_b", 7200, 3900, 300.0) == Estimate(3900, 7200.0, 3600.0, True)


def test_nothing_measured_is_unknown_not_zero() -> None:
    t = Throughput()
    assert t.estimate("batch_x", 10, 100, 0.0) == Estimate(None, None, None, None)
    t.begin("batch_x", "m", 0.0)
    assert t.estimate("batch_x", 10, 100, 5.0) == Estimate(None, None, None, None)


def test_the_elapsed_time_is_at_least_a_second() -> None:
    t = Throughput()
    t.begin("batch_a", "m", 10.0)
    for _ in range(8):
        t.add(10.2, "batch_a", "m", usable=True)
    # 8 records 0.5 s after the start: 8/s (over 1 s), not 16/s; 16 left: 2 s.
    assert t.estimate("batch_a", 16, 20, 10.5) == Estimate(12, 28800.0, 28800.0, True)
