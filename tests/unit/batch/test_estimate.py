"""The estimate's arithmetic on cases computed by hand: rates over busy time (while
a job has lines in flight), the stored rate after a restart, and the basis each
estimate names."""

from __future__ import annotations

from proxy.batch.estimate import NOT_MEASURED, Estimate, Throughput
from proxy.batch.store import Progress


def test_a_job_with_enough_records_uses_its_own_rate() -> None:
    t = Throughput(span_s=300)
    t.begin("batch_a", "m", 1000.0)
    for i in range(10):  # one record a second, every other one usable
        t.add(1000.0 + i, "batch_a", "m", usable=i % 2 == 0)
    # 10 records over the 10 s since the job began: 1/s, 0.5 usable/s; 90 left.
    basis = "measured over 10 lines in 10 s busy"
    assert t.estimate("batch_a", 90, 1100, now=1010.0) == Estimate(
        1100, 3600.0, 1800.0, True, basis
    )
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
    rate = t.rate("batch_a", 140.0)
    assert rate is not None and (rate.per_s, rate.usable_per_s) == (66 / 60, 66 / 60)
    assert rate.basis == "measured over 66 lines in 60 s busy"


def test_time_with_no_line_in_flight_is_not_counted() -> None:
    """Ten lines in 10 s, then 100 s with none in flight (held by a limit), then busy
    again: the rate is 1/s, not 10 over the 110 s since the job began."""
    t = Throughput(span_s=300)
    t.begin("batch_a", "m", 1000.0)
    for i in range(10):  # one line at a time, a second each
        t.sent("batch_a", 1000.0 + i)
        t.add(1001.0 + i, "batch_a", "m", usable=True)
        t.back("batch_a", 1001.0 + i)
    t.sent("batch_a", 1110.0)  # idle from 1010 to 1110
    assert t.estimate("batch_a", 10, 2000, now=1110.0) == Estimate(
        1120, 3600.0, 3600.0, True, "measured over 10 lines in 10 s busy"
    )
    # Busy again: the line in flight for 5 s with no record counts (a stall shows).
    assert t.estimate("batch_a", 10, 2000, now=1115.0).records_per_hour == 2400.0


def test_a_model_idle_between_jobs_keeps_its_rate() -> None:
    t = Throughput(span_s=300)
    t.begin("batch_a", "m", 0.0)
    for s in range(20):  # 2 a second for 20 s, then the job ends
        t.add(s + 0.5, "batch_a", "m", usable=True)
        t.add(s + 0.5, "batch_a", "m", usable=s % 2 == 0)
    t.end("batch_a", 20.0)
    t.begin("batch_b", "m", 200.0)  # 180 s later: the model's clock did not run
    # 40 records in the model's 20 busy seconds: 2/s, 1.5 usable/s; 100 left: 50 s.
    basis = "model m's rate, 40 lines in 20 s busy"
    assert t.estimate("batch_b", 100, 300, now=200.0) == Estimate(250, 7200.0, 5400.0, True, basis)


def test_a_new_job_shares_its_models_rate_and_says_at_once_it_is_late() -> None:
    t = Throughput(span_s=300)
    t.begin("batch_a", "m", 0.0)
    for s in range(1, 301):
        t.add(s + 0.5, "batch_a", "m", usable=True)
        t.add(s + 0.5, "batch_a", "m", usable=False)
    t.begin("batch_b", "m", 300.0)
    # The model did 600 records in 300 s (2/s), now shared by two jobs: 1/s for b.
    late = t.estimate("batch_b", 7200, expires_at=3900, now=300.0)
    shared = "model m's rate, 600 lines in 300 s busy, shared by 2 jobs"
    assert late == Estimate(7500, 3600.0, 1800.0, False, shared)
    t.end("batch_a", 300.0)
    # Alone on the model: 2/s, 7,200 lines in 3,600 s, just within its window.
    alone = Estimate(3900, 7200.0, 3600.0, True, "model m's rate, 600 lines in 300 s busy")
    assert t.estimate("batch_b", 7200, 3900, 300.0) == alone


def test_after_a_restart_the_stored_rate_is_used_until_the_job_has_its_own() -> None:
    stored = Progress(busy_s=40.0, records=80, usable=60)  # 2/s, 1.5 usable/s
    t = Throughput(span_s=300)
    basis = "after restart, from the stored rate: 80 lines in 40 s busy"
    assert t.estimate("batch_a", 100, 5000, 4000.0, stored) == Estimate(
        4050, 7200.0, 5400.0, True, basis
    )
    t.begin("batch_a", "m", 4000.0)
    t.sent("batch_a", 4000.0)
    for i in range(3):  # three of its own: fewer than it takes
        t.add(4001.0 + i, "batch_a", "m", usable=True)
    found = t.estimate("batch_a", 97, 5000, 4003.0, stored)
    assert found.basis == "from the stored rate: 80 lines in 40 s busy"
    assert found.estimated_completion_at == 4003 + 48
    for i in range(5):  # eight: its own rate, 8 lines in 8 s
        t.add(4004.0 + i, "batch_a", "m", usable=True)
    own = t.estimate("batch_a", 92, 5000, 4008.0, stored)
    assert (own.estimated_completion_at, own.basis) == (4100, "measured over 8 lines in 8 s busy")


def test_too_little_stored_is_not_a_rate() -> None:
    t = Throughput()
    few = Progress(busy_s=3.0, records=3, usable=3)
    assert t.estimate("batch_a", 10, 100, 0.0, few) == Estimate(None, None, None, None)


def test_unsaved_progress_is_taken_once_and_kept_when_the_save_fails() -> None:
    t = Throughput()
    assert t.unsaved("batch_a", 0.0) is None
    t.begin("batch_a", "m", 100.0)
    t.sent("batch_a", 100.0)
    for i in range(4):
        t.add(101.0 + i, "batch_a", "m", usable=i != 0)
    taken = t.unsaved("batch_a", 106.0)  # still in flight: 6 busy seconds so far
    assert taken == Progress(6.0, 4, 3)
    t.keep("batch_a", taken)  # the store did not answer
    t.back("batch_a", 107.0)
    t.sent("batch_a", 500.0)  # idle in between
    assert t.unsaved("batch_a", 502.0) == Progress(9.0, 4, 3)
    assert t.unsaved("batch_a", 502.0) is None


def test_nothing_measured_is_unknown_not_zero() -> None:
    t = Throughput()
    nothing = Estimate(None, None, None, None)
    assert nothing.basis == NOT_MEASURED and nothing.body()["basis"] == "not measured yet"
    assert t.estimate("batch_x", 10, 100, 0.0) == nothing
    t.begin("batch_x", "m", 0.0)
    assert t.estimate("batch_x", 10, 100, 5.0) == nothing


def test_the_elapsed_time_is_at_least_a_second() -> None:
    t = Throughput()
    t.begin("batch_a", "m", 10.0)
    for _ in range(8):
        t.add(10.2, "batch_a", "m", usable=True)
    # 8 records 0.5 s after the start: 8/s (over 1 s), not 16/s; 16 left: 2 s.
    basis = "measured over 8 lines in 1 s busy"
    assert t.estimate("batch_a", 16, 20, 10.5) == Estimate(12, 28800.0, 28800.0, True, basis)
