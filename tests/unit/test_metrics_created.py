"""``/metrics`` carries no ``_created`` series, and leaving them out touches no other
registry in the process (the library's switch for it is process-wide)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from tests.unit.api.helpers import CHAT, MESSAGES, FakeEngines, running

pytestmark = pytest.mark.anyio


async def test_metrics_has_no_created_series() -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 3, "stream": True}
        assert (await client.post(CHAT, json=body)).status_code == 200
        text = (await client.get("/metrics")).text
    created = [line for line in text.splitlines() if "_created" in line]
    assert created == []
    # the families that would carry one are there, with their samples
    assert 'whoseturn_requests_total{class="interactive",engine="a",outcome="ok"} 1.0' in text
    assert 'whoseturn_ttft_seconds_count{class="interactive",engine="a"} 1.0' in text


async def test_another_registry_keeps_its_created_series() -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        await client.get("/metrics")
        other = CollectorRegistry()
        Counter("elsewhere", "A counter of another registry", registry=other).inc()
        assert b"elsewhere_created" in generate_latest(other)
