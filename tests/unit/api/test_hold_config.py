"""The hold rules configured (``batch_min_share``, ``hold_timeout_s``) are the ones
every engine's scheduler state runs with."""

from __future__ import annotations

import httpx
import pytest

from proxy.clock import VirtualClock
from proxy.server import build, shutdown

from .helpers import FakeEngines

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


async def test_the_configured_hold_rules_reach_every_engine() -> None:
    engines = FakeEngines(a=["m"], b=["m"])
    settings = engines.settings(batch_min_share=0.25, hold_timeout_s=2.0)
    state = await build(settings, httpx.MockTransport(engines), VirtualClock())
    try:
        rules = [e.rules for e in state.scheduler.engines.values()]
        assert [(r.batch_min_share, r.hold_timeout_s) for r in rules] == [(0.25, 2.0)] * 2
    finally:
        await shutdown(state)
