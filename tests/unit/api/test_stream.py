"""The raw ASGI response that relays a stream (:class:`proxy.api.stream.RelayResponse`),
driven as ASGI with a scripted ``receive``: what the client gets (status, headers,
the engine's bytes, the end of the body), a hang-up mid-stream (the upstream closed
at once, the job released, the outcome ``cancelled``), and an engine that breaks
mid-stream (an OpenAI-style error event and ``[DONE]``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import pytest
from starlette.types import Message

from proxy.server import ProxyState, create_app

from .helpers import CHAT, DONE, MESSAGES, Call, FakeEngines, chat_events

pytestmark = pytest.mark.anyio


class Upstream(httpx.AsyncByteStream):
    """An engine's stream: ``events`` one per read, then ``then`` (None: the end),
    noting whether it was closed."""

    def __init__(self, events: list[bytes], then: Callable[[], Any] | None = None) -> None:
        self.events = events
        self.then = then
        self.closed = anyio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self.events:
            yield event
        if self.then is not None:
            await self.then()

    async def aclose(self) -> None:
        self.closed.set()


@dataclass
class Client:
    """A client's side of one ASGI request: its messages sent to it, and a hang-up
    it makes once ``hang_up_after`` body messages came (None: never)."""

    body: dict[str, Any]
    hang_up_after: int | None = None
    sent: list[Message] = field(default_factory=list)
    _asked: int = 0
    _enough: anyio.Event = field(default_factory=anyio.Event)

    async def receive(self) -> Message:
        self._asked += 1
        if self._asked == 1:
            return {"type": "http.request", "body": json.dumps(self.body).encode()}
        if self.hang_up_after is None:
            await anyio.sleep_forever()
        await self._enough.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        bodies = [m for m in self.sent if m["type"] == "http.response.body"]
        if self.hang_up_after is not None and len(bodies) >= self.hang_up_after:
            self._enough.set()

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])

    @property
    def body_bytes(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])


async def serve(engines: FakeEngines, upstream: Upstream, client: Client) -> ProxyState:
    """One request of ``client`` through the proxy to ``upstream``; the proxy's state."""

    def generate(_: Call) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=upstream)

    engines.generate = generate
    app = create_app(engines.settings(), transport=httpx.MockTransport(engines))
    scope: dict[str, Any] = {"type": "http", "method": "POST", "path": CHAT}
    scope |= {"headers": [(b"content-type", b"application/json")], "query_string": b""}
    scope |= {"root_path": "", "scheme": "http", "http_version": "1.1"}
    scope |= {"asgi": {"version": "3.0", "spec_version": "2.3"}, "state": {}}
    async with app.router.lifespan_context(app):
        with anyio.fail_after(5):
            await app(scope | {"app": app}, client.receive, client.send)
        state: ProxyState = app.state.proxy
        return state


def outcome(state: ProxyState, name: str) -> float:
    labels = {"class": "interactive", "engine": "a", "outcome": name}
    value = state.metrics.registry.get_sample_value("whoseturn_requests_total", labels)
    return value or 0.0


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MESSAGES, "stream": True, **extra}


def released(state: ProxyState) -> bool:
    report = state.admission.report()[0]
    none = {"interactive": 0, "batch": 0}
    return bool(report["prefill_tokens"] == none and report["decode_streams"] == none)


async def test_the_engine_bytes_relayed_unchanged_with_the_headers() -> None:
    events = chat_events()
    upstream = Upstream(events)
    client = Client(chat(stream_options={"include_usage": True}))
    state = await serve(FakeEngines(), upstream, client)
    start = client.sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert client.headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert client.headers[b"x-whoseturn-engine"] == b"a"
    assert client.headers[b"x-whoseturn-class"] == b"interactive"
    assert b"x-request-id" in client.headers
    assert client.body_bytes == b"".join(events)
    # one message per event, then the end of the body
    assert [m["body"] for m in client.sent[1:-1]] == events
    assert client.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert upstream.closed.is_set()
    assert outcome(state, "ok") == 1 and released(state)


async def test_the_usage_chunk_is_dropped_unless_the_client_asked_for_it() -> None:
    events = chat_events()
    client = Client(chat())
    await serve(FakeEngines(), Upstream(events), client)
    usage = [e for e in events if b'"usage"' in e]
    assert len(usage) == 1
    assert client.body_bytes == b"".join(e for e in events if e not in usage)


async def test_a_hang_up_mid_stream_closes_the_upstream_at_once() -> None:
    upstream = Upstream(chat_events()[:2], then=anyio.sleep_forever)
    client = Client(chat(), hang_up_after=2)
    state = await serve(FakeEngines(), upstream, client)
    assert upstream.closed.is_set(), "the engine's response was left open"
    assert client.body_bytes == b"".join(chat_events()[:2])
    assert all(m.get("more_body", False) for m in client.sent[1:]), "no end after a hang-up"
    assert outcome(state, "cancelled") == 1 and outcome(state, "ok") == 0
    assert released(state)


async def test_an_engine_broken_mid_stream_ends_with_an_error_event_and_done() -> None:
    async def broken() -> None:
        raise httpx.ReadError("connection reset")

    upstream = Upstream(chat_events()[:2], then=broken)
    client = Client(chat())
    state = await serve(FakeEngines(), upstream, client)
    body = client.body_bytes
    assert body.startswith(b"".join(chat_events()[:2]))
    error_event, done = body[len(b"".join(chat_events()[:2])) :].split(b"\n\n")[:2]
    error = json.loads(error_event.removeprefix(b"data: "))["error"]
    assert error["type"] == "engine_error" and "mid-stream" in error["message"]
    assert done + b"\n\n" == DONE
    assert client.sent[-1]["more_body"] is False
    assert upstream.closed.is_set()
    assert outcome(state, "engine_error") == 1 and released(state)
