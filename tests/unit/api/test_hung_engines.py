"""Hung engines: each phase of an upstream stream has a read timeout; silence past
it ends the client's answer with an error, closes the upstream request, and ejects
the engine (outlier detection) until a health check readmits it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

from proxy.api.sse import SSEReader

from .helpers import (
    CHAT,
    MESSAGES,
    Call,
    FakeEngines,
    chat_events,
    running,
    stream_response,
)

pytestmark = pytest.mark.anyio

IDLE_S = 0.2
FIRST_BYTE_S = 0.3


def timeouts(engines: FakeEngines, **extra: Any) -> Any:
    """Short read timeouts; health checks only when the test runs them (a passing
    one readmits an ejected engine)."""
    return engines.settings(
        first_byte_timeout_s=FIRST_BYTE_S, idle_timeout_s=IDLE_S, health_interval_s=600, **extra
    )


class Silent:
    """An engine stream that sends ``events`` and then nothing, until closed."""

    def __init__(self, events: list[bytes]) -> None:
        self.events = events
        self.closed = anyio.Event()

    async def body(self) -> AsyncIterator[bytes]:
        try:
            for event in self.events:
                yield event
            await anyio.sleep_forever()
        finally:
            self.closed.set()

    def response(self) -> httpx.Response:
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=self.body()
        )


async def test_a_stream_silent_past_the_idle_timeout_ends_with_an_error_and_done() -> None:
    engines = FakeEngines()
    silent = Silent(chat_events()[:3])
    engines.generate = lambda call: silent.response()
    async with running(timeouts(engines), engines) as (client, state):
        started = time.monotonic()
        body = {"model": "m", "messages": MESSAGES, "stream": True}
        response = await client.post(CHAT, json=body)
        elapsed = time.monotonic() - started
        assert not state.monitor.up["a"]  # ejected: a timeout is taken as a hung engine
    sent = b"".join(silent.events)
    assert response.content.startswith(sent)
    tail = SSEReader().feed(response.content[len(sent) :])
    assert tail[0].error is not None and "sent nothing" in tail[0].error["message"]
    assert tail[-1].done
    assert silent.closed.is_set()  # the upstream request was closed (vLLM aborts it)
    assert IDLE_S <= elapsed < IDLE_S + 1.0


async def test_no_first_chunk_in_time_is_retried_on_another_engine() -> None:
    engines = FakeEngines(a=["m"], b=["m"])
    silent = Silent([])

    def generate(call: Call) -> httpx.Response:
        first = len(engines.seen(CHAT)) == 1
        return silent.response() if first else stream_response(chat_events())

    engines.generate = generate
    async with running(timeouts(engines), engines) as (client, state):
        response = await client.post(CHAT, json={"model": "m", "messages": MESSAGES})
        hung = engines.seen(CHAT)[0].engine
        assert not state.monitor.up[hung]
    other = "b" if hung == "a" else "a"
    assert response.status_code == 200
    assert response.headers["x-whoseturn-engine"] == other
    assert silent.closed.is_set()


async def test_no_response_headers_in_time_is_retried_on_another_engine() -> None:
    engines = FakeEngines(a=["m"], b=["m"])

    async def generate(call: Call) -> httpx.Response:
        if len(engines.seen(CHAT)) == 1:
            await anyio.sleep_forever()
        return stream_response(chat_events())

    engines.generate = generate
    async with running(timeouts(engines), engines) as (client, state):
        with anyio.fail_after(FIRST_BYTE_S + 2):
            response = await client.post(CHAT, json={"model": "m", "messages": MESSAGES})
        hung = engines.seen(CHAT)[0].engine
        assert not state.monitor.up[hung]
    assert response.status_code == 200
    assert response.headers["x-whoseturn-engine"] != hung


async def test_consecutive_failures_eject_and_a_success_resets_the_count() -> None:
    engines = FakeEngines()
    failing = [True]

    def generate(call: Call) -> httpx.Response:
        if failing[0]:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        return stream_response(chat_events())

    engines.generate = generate
    body = {"model": "m", "messages": MESSAGES}
    async with running(timeouts(engines, outlier_consecutive_errors=3), engines) as (
        client,
        state,
    ):
        for _ in range(2):
            assert (await client.post(CHAT, json=body)).status_code == 500
        failing[0] = False
        assert (await client.post(CHAT, json=body)).status_code == 200
        failing[0] = True
        for _ in range(2):
            assert (await client.post(CHAT, json=body)).status_code == 500
        assert state.monitor.up["a"]  # two in a row since the success: not yet
        assert (await client.post(CHAT, json=body)).status_code == 500
        assert not state.monitor.up["a"]
        await state.monitor.check_health()  # its health check passes: readmitted
        assert state.monitor.up["a"]
