"""A client that hangs up aborts its request in the engine at once."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import anyio
import anyio.lowlevel
import httpx
import pytest
from starlette.types import Message

from loadtests.sim.server import SimState, create_sim_app
from tests.support.http import post_raw

from .simserver import SimServer, abort_latencies, hang_up_while_running, sim_settings

pytestmark = pytest.mark.integration

# Real time, so that the engine is doing nothing but the request under test.
LONG = {"max_tokens": 1500}
ABORT_WITHIN_S = 0.1
TRIES = 3


def assert_aborts_quickly(sim: SimServer, leave: Callable[[], float]) -> None:
    """``leave()`` starts a request, hangs up while the engine runs it, and returns
    when it hung up; the engine must drop it within ``ABORT_WITHIN_S`` (tried up to
    ``TRIES`` times, see :func:`.simserver.abort_latencies`)."""
    latencies = abort_latencies(sim, leave, within_s=ABORT_WITHIN_S, tries=TRIES)
    shown = ", ".join(f"{t * 1000:.0f}" for t in latencies)
    assert latencies[-1] < ABORT_WITHIN_S, f"the engine kept the request {shown} ms"
    assert sim.metric("vllm:num_requests_waiting") == 0
    assert sim.metric("vllm:request_success_total", finished_reason="abort") == len(latencies)
    assert sim.metric("vllm:kv_cache_usage_perc") == 0


CHAT = {"messages": [{"role": "user", "content": "tell me everything"}]}
TEXT = {"prompt": "tell me everything"}


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)]
)
def test_closing_a_stream_aborts_the_request(
    slow_sim: SimServer, path: str, body: dict[str, object]
) -> None:
    def leave() -> float:
        with httpx.Client(base_url=slow_sim.base_url, timeout=10) as client:
            with client.stream("POST", path, json={**body, **LONG, "stream": True}) as response:
                events = (line for line in response.iter_lines() if line.startswith("data: "))
                for _ in range(3):
                    next(events)
                assert slow_sim.requests_running() == 1
            return time.monotonic()

    assert_aborts_quickly(slow_sim, leave)


def test_hanging_up_on_a_whole_answer_aborts_the_request(slow_sim: SimServer) -> None:
    def leave() -> float:
        sock = post_raw(slow_sim.port, "/v1/chat/completions", {**CHAT, **LONG})
        return hang_up_while_running(slow_sim, sock, after_s=0.05)

    assert_aborts_quickly(slow_sim, leave)


def test_hanging_up_while_queued_aborts_the_waiting_request(slow_sim: SimServer) -> None:
    # 2,000 prompt tokens fill one step of the 2,048-token budget: ~0.4 s of prefill.
    first = post_raw(
        slow_sim.port, "/v1/completions", {"prompt": list(range(100, 2100)), "max_tokens": 40}
    )
    try:
        slow_sim.wait_for(lambda: slow_sim.requests_running() == 1, timeout=2)
        second = post_raw(slow_sim.port, "/v1/completions", {"prompt": "me next", "max_tokens": 5})
        slow_sim.wait_for(lambda: slow_sim.metric("vllm:num_requests_waiting") == 1, timeout=1)
        second.close()
        closed_at = time.monotonic()
        slow_sim.wait_for(lambda: slow_sim.metric("vllm:num_requests_waiting") == 0, timeout=1)
        assert time.monotonic() - closed_at < ABORT_WITHIN_S
        assert slow_sim.metric("vllm:request_success_total", finished_reason="abort") == 1
        assert slow_sim.requests_running() == 1
    finally:
        first.close()
    slow_sim.wait_for(lambda: slow_sim.requests_running() == 0, timeout=1)


@pytest.mark.anyio
async def test_a_client_gone_before_the_first_event_still_aborts() -> None:
    """Driven through ASGI: the hang-up is seen before the event generator ever ran."""
    app = create_sim_app(sim_settings(time_scale=1.0))
    body = json.dumps({**TEXT, **LONG, "stream": True}).encode()
    inbox: list[Message] = [
        {"type": "http.request", "body": body, "more_body": False},
        {"type": "http.disconnect"},
    ]

    async def receive() -> Message:
        if not inbox:
            await anyio.sleep_forever()
        return inbox.pop(0)

    async def send(message: Message) -> None:
        await anyio.lowlevel.checkpoint()  # a server's send may yield; the hang-up lands here

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 80),
    }
    async with app.router.lifespan_context(app):
        with anyio.fail_after(5):
            await app(scope, receive, send)
        state = app.state.sim
        assert isinstance(state, SimState)
        assert state.engine.num_running + state.engine.num_waiting == 0
        assert state.driver.num_streams == 0
