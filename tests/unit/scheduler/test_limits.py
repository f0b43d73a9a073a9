"""The tenants' limits over a virtual clock: sliding one-minute windows of requests
and tokens, requests in flight, batch lines and jobs; Retry-After when the window
has freed enough; reads that change nothing."""

from __future__ import annotations

import copy

import pytest

from proxy.clock import VirtualClock
from proxy.config import Tenant, TenantLimits
from proxy.scheduler.limits import (
    REQUESTS_PER_MINUTE,
    STREAMS,
    TOKENS_PER_MINUTE,
    Refusal,
    TenantMeter,
    Usage,
)


def tenant(name: str = "t", **limits: int) -> Tenant:
    return Tenant(name=name, limits=TenantLimits(**limits), configured=True)


def test_a_tenant_without_limits_is_never_refused_and_costs_nothing() -> None:
    clock = VirtualClock()
    meter = TenantMeter(clock)
    free = tenant()
    for _ in range(1000):
        assert meter.check(free, 10**9) is None
        meter.started(free, 10**9)
    assert meter.usage("t") == Usage()
    assert meter.batch_lines_room(free) and meter.batch_job_room(free)


def test_requests_per_minute_slide_and_say_when_to_retry() -> None:
    clock = VirtualClock()
    meter = TenantMeter(clock)
    t = tenant(requests_per_minute=3)
    for at in (0.0, 10.0, 20.0):
        clock.advance_to(at)
        assert meter.check(t, 0) is None
        meter.started(t, 0)
        meter.finished(t, 0)
    clock.advance_to(25.0)
    refusal = meter.check(t, 0)
    assert refusal == Refusal(REQUESTS_PER_MINUTE, 35.0, "t", 3, 3)
    assert refusal.retry_after == 35 and refusal.kind == "requests"
    clock.advance_to(59.9)
    assert meter.check(t, 0) is not None  # the first request is still in the window
    clock.advance_to(60.0)
    assert meter.check(t, 0) is None  # ... and has left it at 60 s
    meter.started(t, 0)
    refusal = meter.check(t, 0)
    assert refusal is not None and refusal.retry_after_s == pytest.approx(10.0)


def test_tokens_count_prompt_at_start_and_completion_at_the_end() -> None:
    clock = VirtualClock()
    meter = TenantMeter(clock)
    t = tenant(tokens_per_minute=1000)
    meter.started(t, 400)
    clock.advance(5.0)
    meter.finished(t, 300)  # 700 in the window: 400 at 0 s, 300 at 5 s
    assert meter.usage("t").tokens == 700
    assert meter.check(t, 300) is None
    refusal = meter.check(t, 301)
    assert refusal is not None
    assert (refusal.limit, refusal.kind, refusal.used, refusal.allowed) == (
        TOKENS_PER_MINUTE,
        "tokens",
        700,
        1000,
    )
    assert refusal.retry_after_s == pytest.approx(55.0)  # the 400 at 0 s frees enough
    refusal = meter.check(t, 701)
    assert refusal is not None and refusal.retry_after_s == pytest.approx(60.0)  # both must go
    assert refusal.retry_after == 60


def test_a_prompt_larger_than_the_limit_is_too_large_not_merely_early() -> None:
    meter = TenantMeter(VirtualClock())
    refusal = meter.check(tenant(tokens_per_minute=100), 101)
    assert refusal is not None and refusal.too_large
    assert "too large" in refusal.message() and "101" in refusal.message()


def test_streams_in_flight() -> None:
    clock = VirtualClock()
    meter = TenantMeter(clock)
    t = tenant(streams=2)
    meter.started(t, 10)
    meter.started(t, 10)
    refusal = meter.check(t, 0)
    assert refusal is not None and (refusal.limit, refusal.used, refusal.retry_after) == (
        STREAMS,
        2,
        1,
    )
    meter.finished(t, 5)
    assert meter.check(t, 0) is None


def test_the_refusal_that_waits_longest_is_given() -> None:
    clock = VirtualClock()
    meter = TenantMeter(clock)
    t = tenant(tokens_per_minute=100, streams=1)
    meter.started(t, 90)  # at 0 s
    clock.advance(30.0)
    meter.finished(t, 0)
    meter.started(t, 5)  # at 30 s: 95 tokens, 1 stream
    refusal = meter.check(t, 10)
    # the stream is retried in 1 s, but the tokens free only at 60 s (the 90 at 0 s)
    assert refusal is not None and refusal.limit == TOKENS_PER_MINUTE
    assert refusal.retry_after_s == pytest.approx(30.0)


def test_reads_change_nothing() -> None:
    clock = VirtualClock()
    meter = TenantMeter(clock)
    t = tenant(requests_per_minute=2, tokens_per_minute=50, streams=5, batch_lines=1, batch_jobs=1)
    meter.started(t, 40)
    meter.line_started(t)
    meter.job_started(t)
    clock.advance(61.0)  # the request left the window; no write has dropped it yet
    before = copy.deepcopy(meter._uses)
    for _ in range(3):
        assert meter.check(t, 10) is None
        assert not meter.batch_lines_room(t)
        assert not meter.batch_job_room(t)
        assert meter.usage("t") == Usage(requests=0, tokens=0, streams=1, lines=1, jobs=1)
    assert meter._uses == before
    assert meter.check(t, 10) is None  # a check that passes does not count the request
    assert meter.usage("t").requests == 0


def test_batch_lines_and_jobs_in_flight() -> None:
    meter = TenantMeter(VirtualClock())
    t = tenant(batch_lines=2, batch_jobs=1)
    meter.line_started(t)
    assert meter.batch_lines_room(t)
    meter.line_started(t)
    assert not meter.batch_lines_room(t)
    meter.line_finished(t)
    assert meter.batch_lines_room(t)
    assert meter.batch_job_room(t)
    meter.job_started(t)
    assert not meter.batch_job_room(t)
    assert meter.batch_job_room(t, running=0)  # the caller's own count, where it keeps one
    assert not meter.batch_job_room(t, running=1)
    meter.job_finished(t)
    assert meter.batch_job_room(t)


def test_tenants_are_kept_apart() -> None:
    meter = TenantMeter(VirtualClock())
    a, b = tenant("a", requests_per_minute=1), tenant("b", requests_per_minute=1)
    meter.started(a, 0)
    assert meter.check(a, 0) is not None
    assert meter.check(b, 0) is None


def test_an_idle_tenant_is_forgotten() -> None:
    clock = VirtualClock()
    meter = TenantMeter(clock)
    t = tenant(requests_per_minute=5)
    meter.started(t, 0)
    clock.advance(60.0)
    meter.finished(t, 0)  # the window emptied and nothing is in flight
    assert meter._uses == {}


def test_the_message_names_the_tenant_the_limit_and_the_wait() -> None:
    refusal = Refusal(TOKENS_PER_MINUTE, 6.2, "team-a", 1000, 990)
    assert refusal.message() == (
        "Rate limit reached for tenant team-a: tokens_per_minute 1000 (used 990); retry after 7 s"
    )
    assert Refusal(STREAMS, 0.0, "x").retry_after == 1  # never 0
