"""Issue #16's regression guard: a quick run of the overhead benchmark.

The free upstream, the proxy with default settings, and 64 streams of 32 tokens,
direct and through ``/v1``, twice each and interleaved. It fails only when the
proxy's added TTFT p50 (through the proxy minus direct, best of the two rounds)
is more than :data:`MARGIN` times the full run's figure recorded in
docs/overhead.md, so a relay change that makes every stream slow is caught and a
loaded machine is not.
"""

from __future__ import annotations

import pytest

from loadtests.bench.overhead import Plan, run_arms

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

# Added TTFT p50 at 64 streams in the full run of docs/overhead.md (seconds).
RECORDED_ADDED_TTFT_P50_S = 0.068
MARGIN = 5.0
STREAMS = 64


def test_added_ttft_at_64_streams_stays_within_margin() -> None:
    plan = Plan(levels=(STREAMS,), tokens=32, arms=("direct", "whoseturn"))
    added = []
    for _ in range(2):
        rows = run_arms(plan)
        direct, proxied = rows["direct", 1000, STREAMS], rows["whoseturn", 1000, STREAMS]
        assert proxied["errors"] == 0, proxied["first_error"]
        assert proxied["tokens"] == STREAMS * plan.tokens
        added.append(proxied["ttft_p50"] - direct["ttft_p50"])
    best = min(added)
    limit = MARGIN * RECORDED_ADDED_TTFT_P50_S
    assert best <= limit, f"added TTFT p50 {best * 1000:.0f} ms > {limit * 1000:.0f} ms"
