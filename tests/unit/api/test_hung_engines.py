"""Hung engines: each phase of an upstream stream has a read timeout; silence past
it ends the client's answer with an error, closes the upstream request, and ejects
the engine (outlier detection) until a health check readmits it. A request still
waiting for its answer to begin on an engine the monitor ejects is taken off it at
once: sent to another engine, or failed when none is left, not left to its
``first_byte_timeout_s``; one whose answer began is left alone."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
import pytest

from proxy.api.sse import SSEReader
from proxy.config import Settings
from proxy.server import ProxyState
from tests.support.polling import wait_until

from .helpers import (
    CHAT,
    DONE,
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
    fields = {"first_byte_timeout_s": FIRST_BYTE_S, "idle_timeout_s": IDLE_S, **extra}
    return engines.settings(health_interval_s=600, **fields)


class Silent:
    """An engine stream that sends ``events`` and then nothing, until closed (or,
    once ``resume`` is set, ``rest``)."""

    def __init__(self, events: list[bytes], rest: list[bytes] | None = None) -> None:
        self.events = events
        self.rest = rest
        self.reading = anyio.Event()  # the proxy reads the body
        self.resume = anyio.Event()
        self.closed = anyio.Event()

    async def body(self) -> AsyncIterator[bytes]:
        self.reading.set()
        try:
            for event in self.events:
                yield event
            if self.rest is None:
                await anyio.sleep_forever()
            await self.resume.wait()
            for event in self.rest:
                yield event
        finally:
            self.closed.set()

    def response(self) -> httpx.Response:
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=self.body()
        )


def hangs_first(engines: FakeEngines, hung: Callable[[], Any]) -> None:
    """``engines`` answer their first chat request with ``hung()`` (a response, or an
    awaitable of one, that stalls) and every later one with a whole stream."""

    def generate(call: Call) -> Any:
        first = len(engines.seen(CHAT)) == 1
        return hung() if first else stream_response(chat_events())

    engines.generate = generate


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
    hangs_first(engines, silent.response)
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
    hangs_first(engines, anyio.sleep_forever)
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


# -- an engine ejected while requests wait for its answer ---------------------------

FIRST_BYTE_LONG_S = 30.0
"""Long enough that an answer within :data:`CUT_WITHIN_S` of the ejection cannot be
this timeout's doing."""
CUT_WITHIN_S = 2.0


class Ailing(FakeEngines):
    """Fake engines whose ``/health`` fails (503) for the names in ``sick``."""

    def __init__(self, **models: list[str]) -> None:
        super().__init__(**models)
        self.sick: set[str] = set()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health" and request.url.host.split(".")[0] in self.sick:
            return httpx.Response(503)
        return await super().__call__(request)


class Unanswered:
    """An engine that took the request and sends nothing back, not even a response
    head, until the proxy gives up on it."""

    def __init__(self) -> None:
        self.closed = anyio.Event()

    async def respond(self) -> httpx.Response:
        try:
            await anyio.sleep_forever()
        finally:
            self.closed.set()
        raise AssertionError("unreachable")


def ejecting(engines: Ailing, **extra: Any) -> Settings:
    """One failed health check ejects; the first byte may take long."""
    return timeouts(engines, unhealthy_after=1, first_byte_timeout_s=FIRST_BYTE_LONG_S, **extra)


async def eject_meanwhile(
    client: httpx.AsyncClient,
    state: ProxyState,
    engines: Ailing,
    body: dict[str, Any],
    ready: anyio.Event | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[httpx.Response, str, float]:
    """Send ``body``; once the first engine has it (and ``ready`` is set), fail that
    engine's health check, which ejects it. The response, that engine, and the
    seconds from the ejection to the response."""
    answers: list[httpx.Response] = []

    async def send() -> None:
        answers.append(await client.post(CHAT, json=body, headers=headers or {}))

    with anyio.fail_after(FIRST_BYTE_LONG_S / 3):
        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            await wait_until(lambda: len(engines.seen(CHAT)) == 1)
            if ready is not None:
                await ready.wait()
            hung = engines.seen(CHAT)[0].engine
            engines.sick.add(hung)
            ejected_at = time.monotonic()
            await state.monitor.check_health()
            assert not state.monitor.up[hung]
    return answers[0], hung, time.monotonic() - ejected_at


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_without_response_head_goes_to_another_engine_on_ejection(
    stream: bool,
) -> None:
    engines = Ailing(a=["m"], b=["m"])
    unanswered = Unanswered()
    hangs_first(engines, unanswered.respond)
    body = {"model": "m", "messages": MESSAGES, "stream": stream}
    async with running(ejecting(engines), engines) as (client, state):
        response, hung, waited_s = await eject_meanwhile(client, state, engines, body)
    assert response.status_code == 200, response.text
    assert response.headers["x-whoseturn-engine"] != hung
    other = response.headers["x-whoseturn-engine"]
    assert [c.engine for c in engines.seen(CHAT)] == [hung, other]  # sent once more there
    assert waited_s < CUT_WITHIN_S  # not the first-byte timeout (30 s)
    assert unanswered.closed.is_set()  # the upstream request was given up
    if stream:
        events = SSEReader().feed(response.content)
        assert all(e.error is None for e in events) and events[-1].done
    else:
        assert response.json()["choices"][0]["message"]["content"] == "Hello world!"


async def test_no_engine_left_fails_the_waiting_request_at_once() -> None:
    engines = Ailing(a=["m"])
    unanswered = Unanswered()
    engines.generate = lambda call: unanswered.respond()
    body = {"model": "m", "messages": MESSAGES}
    async with running(ejecting(engines), engines) as (client, state):
        response, _, waited_s = await eject_meanwhile(client, state, engines, body)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["type"] == "service_unavailable"
    assert "ejected: 1 health checks failed in a row" in error["message"]
    assert waited_s < CUT_WITHIN_S
    assert unanswered.closed.is_set()
    assert len(engines.seen(CHAT)) == 1


async def test_no_first_chunk_yet_a_whole_answer_goes_to_another_engine_on_ejection() -> None:
    engines = Ailing(a=["m"], b=["m"])
    silent = Silent([])
    hangs_first(engines, silent.response)
    body = {"model": "m", "messages": MESSAGES}
    async with running(ejecting(engines), engines) as (client, state):
        response, hung, waited_s = await eject_meanwhile(
            client, state, engines, body, silent.reading
        )
    assert response.status_code == 200, response.text
    assert response.headers["x-whoseturn-engine"] != hung
    assert waited_s < CUT_WITHIN_S
    assert silent.closed.is_set()


async def test_no_first_chunk_yet_a_begun_stream_ends_with_an_error_on_ejection() -> None:
    """The client's response began with the engine's head (its headers name the
    engine): it cannot be sent elsewhere, so it ends now, not at the timeout."""
    engines = Ailing(a=["m"], b=["m"])
    silent = Silent([])
    engines.generate = lambda call: silent.response()
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    async with running(ejecting(engines), engines) as (client, state):
        response, hung, waited_s = await eject_meanwhile(
            client, state, engines, body, silent.reading
        )
    assert response.status_code == 200
    assert response.headers["x-whoseturn-engine"] == hung
    events = SSEReader().feed(response.content)
    assert events[0].error is not None and "ejected" in events[0].error["message"]
    assert events[-1].done
    assert waited_s < CUT_WITHIN_S
    assert silent.closed.is_set()
    assert len(engines.seen(CHAT)) == 1


async def test_an_abortable_batch_request_without_first_chunk_goes_to_another_engine() -> None:
    """A batch request that may be aborted in prefill reads the engine's first chunk
    before its client's response starts: even a streaming one is sent elsewhere."""
    engines = Ailing(a=["m"], b=["m"])
    silent = Silent([])
    hangs_first(engines, silent.response)
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    batch = {"X-Whoseturn-Class": "batch"}
    async with running(ejecting(engines, batch_abort="on"), engines) as (client, state):
        response, hung, waited_s = await eject_meanwhile(
            client, state, engines, body, silent.reading, batch
        )
    assert response.status_code == 200, response.text
    assert response.headers["x-whoseturn-class"] == "batch"
    assert response.headers["x-whoseturn-engine"] != hung
    events = SSEReader().feed(response.content)
    assert all(e.error is None for e in events) and events[-1].done
    assert waited_s < CUT_WITHIN_S
    assert silent.closed.is_set()


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_begun_is_not_cut_by_its_engines_ejection(stream: bool) -> None:
    """The engine's first chunk came before the ejection: the answer goes on there
    (a stream is relayed already, and nothing is ever sent twice for it)."""
    engines = Ailing(a=["m"], b=["m"])
    events = chat_events()
    silent = Silent(events[:2], rest=events[2:])
    engines.generate = lambda call: silent.response()
    body = {"model": "m", "messages": MESSAGES, "stream": stream}
    settings = ejecting(engines, idle_timeout_s=FIRST_BYTE_LONG_S)  # silence is no failure
    async with running(settings, engines) as (client, state):
        answers: list[httpx.Response] = []

        async def send() -> None:
            answers.append(await client.post(CHAT, json=body))

        with anyio.fail_after(FIRST_BYTE_LONG_S / 3):
            async with anyio.create_task_group() as tg:
                tg.start_soon(send)
                await wait_until(lambda: silent.reading.is_set())
                await anyio.sleep(0.1)  # the first chunks are read
                hung = engines.seen(CHAT)[0].engine
                engines.sick.add(hung)
                await state.monitor.check_health()
                assert not state.monitor.up[hung]
                await anyio.sleep(0.1)
                assert not answers  # still waiting for the rest there
                silent.resume.set()
    response = answers[0]
    assert response.status_code == 200
    assert response.headers["x-whoseturn-engine"] == hung
    assert len(engines.seen(CHAT)) == 1
    if stream:
        assert response.content.endswith(DONE)
        assert all(e.error is None for e in SSEReader().feed(response.content))
    else:
        assert response.json()["choices"][0]["message"]["content"] == "Hello world!"
