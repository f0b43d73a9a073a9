"""The proxy's engine client against a real simulated engine on a loopback socket."""

from __future__ import annotations

import time

import anyio
import pytest

from proxy.config import EngineConfig, Settings
from proxy.engines import EngineHTTPError, EnginePool, make_http_client
from proxy.scheduler import EngineLoad
from tests.support.polling import wait_until

from .simserver import MODEL, SimServer

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Whose turn is it, and why?"},
]
ABORT_WITHIN_S = 0.1


def settings_for(sim: SimServer) -> Settings:
    return Settings(engines=(EngineConfig(url=sim.base_url, name="sim"),))


def sim_load(sim: SimServer) -> EngineLoad:
    return EngineLoad(
        kv_usage=sim.metric("vllm:kv_cache_usage_perc"),
        waiting=int(sim.metric("vllm:num_requests_waiting")),
        running=int(sim.metric("vllm:num_requests_running")),
    )


def sim_count(sim: SimServer, body: dict[str, object]) -> int:
    response = sim.http.post("/tokenize", json={"model": MODEL, **body})
    response.raise_for_status()
    return int(response.json()["count"])


async def test_control_calls_agree_with_the_sim(sim: SimServer) -> None:
    settings = settings_for(sim)
    async with make_http_client(settings) as http:
        pool = EnginePool(settings.engines, http)
        engine = pool.client_for("sim")
        assert await pool.discover() == {"sim": (MODEL,)}
        assert await engine.models() == [MODEL]
        assert await engine.health() is True
        assert await engine.load() == sim_load(sim) == EngineLoad()
        prompt = "the quick brown fox jumps over the lazy dog " * 20
        assert await engine.count_tokens(MODEL, prompt=prompt) == sim_count(sim, {"prompt": prompt})
        counted = await engine.count_tokens(MODEL, messages=MESSAGES)
        assert counted == sim_count(sim, {"messages": MESSAGES}) > 0
        with pytest.raises(EngineHTTPError) as caught:
            await engine.count_tokens("no-such-model", prompt="x")
        assert caught.value.status == 404
        assert b"no-such-model" in caught.value.body


async def test_closing_a_stream_aborts_the_request_in_the_engine(slow_sim: SimServer) -> None:
    settings = settings_for(slow_sim)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1500, "stream": True}
    async with make_http_client(settings) as http:
        engine = EnginePool(settings.engines, http).client_for("sim")
        with anyio.fail_after(10):
            async with engine.stream("/v1/chat/completions", body) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                # Not `break` out of `async for`: the abandoned generator would be
                # finalized at once, and that closes the connection too early.
                chunks = response.aiter_raw()
                events = 0
                while events < 3:
                    events += (await anext(chunks)).count(b"data: ")
                assert (await engine.load()).running == 1
            closed_at = time.monotonic()
            await wait_until(lambda: slow_sim.metric("vllm:num_requests_running") == 0)
            took = time.monotonic() - closed_at
    assert took < ABORT_WITHIN_S
    assert slow_sim.metric("vllm:request_success_total", finished_reason="abort") == 1
    assert settled_load(slow_sim) == EngineLoad()


def settled_load(sim: SimServer) -> EngineLoad:
    sim.wait_for(lambda: sim_load(sim) == EngineLoad(), timeout=2)
    return sim_load(sim)
