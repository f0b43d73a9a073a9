"""The overhead benchmark's free upstream answers what a router asks before it
routes (``/health``, ``/v1/models``), and, where ``.venv-router`` is built (``make
bench``), a short run through the ``vllm-router`` arm relays every token of a
100,000-character prompt's answer."""

from __future__ import annotations

import httpx
import pytest

from loadtests.bench.overhead import Plan, run_arms, upstream_server
from loadtests.bench.overhead_router import router_binary
from loadtests.support.processes import loopback_url

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_upstream_answers_health_and_models() -> None:
    with upstream_server(tokens=4, interval_s=0.01) as port:
        base = loopback_url(port)
        assert httpx.get(base + "/health").status_code == 200
        models = httpx.get(base + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["bench"]


@pytest.mark.skipif(router_binary() is None, reason=".venv-router not built (make bench)")
def test_router_arm_relays_a_long_prompt() -> None:
    plan = Plan(levels=(4,), prompt_chars=(100_000,), tokens=8, arms=("direct", "vllm-router"))
    row = run_arms(plan)["vllm-router", 100_000, 4]
    assert row["errors"] == 0, row["first_error"]
    assert row["tokens"] == 4 * 8
    assert "cpu_s" in row and "rss_per_stream" in row  # the router's process was measured
