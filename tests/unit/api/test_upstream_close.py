"""The proxy closes the engine's response itself when a client leaves after the
upstream request opened, before any token came back.

Over real sockets the close has a second line that hides a missing one: httpcore
closes its connection when a read in progress is cancelled or its iterator is
finalized. The engine's response here is a plain byte stream that does neither,
so only the proxy's own close (its exit stack, and the engine client's
``close_now``) can close it. The app is driven as ASGI with a scripted
``receive``: the request body, then silence while the upstream opens, then the
hang-up as soon as the response listens for one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from starlette.types import Message

from proxy.server import create_app

from .helpers import COMPLETIONS, Call, FakeEngines

pytestmark = pytest.mark.anyio


class Unread(httpx.AsyncByteStream):
    """An engine's response body that sends nothing and notes whether it was closed."""

    def __init__(self) -> None:
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        await anyio.sleep_forever()
        yield b""  # pragma: no cover - never reached

    async def aclose(self) -> None:
        self.closed = True


async def test_a_client_that_leaves_before_the_first_read_closes_the_upstream() -> None:
    engines = FakeEngines()
    upstream = Unread()

    def generate(_: Call) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=upstream)

    engines.generate = generate
    app = create_app(engines.settings(), transport=httpx.MockTransport(engines))
    body = b'{"model": "m", "prompt": "hello", "max_tokens": 5, "stream": true}'
    received = 0
    sent: list[Message] = []
    answer_begun = anyio.Event()

    async def receive() -> Message:
        nonlocal received
        received += 1
        if received == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        # The client leaves once the answer has begun, before the engine sent a byte
        # (while the proxy waits for the turn and opens the upstream, it stays).
        await answer_begun.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)
        if message["type"] == "http.response.start":
            answer_begun.set()

    headers = [(b"content-type", b"application/json")]
    scope: dict[str, Any] = {"type": "http", "method": "POST", "path": COMPLETIONS}
    scope |= {"headers": headers, "query_string": b"", "root_path": "", "scheme": "http"}
    scope |= {"http_version": "1.1", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    async with app.router.lifespan_context(app):
        with anyio.fail_after(5):
            await app(scope | {"app": app, "state": {}}, receive, send)
        report = app.state.proxy.admission.report()
    assert engines.seen(COMPLETIONS), "the request never reached the engine"
    assert upstream.closed, "the engine's response was left open"
    assert report[0]["prefill_tokens"] == {"interactive": 0, "batch": 0}
    assert report[0]["decode_streams"] == {"interactive": 0, "batch": 0}
    assert report[0]["queued"] == {"interactive": 0, "batch": 0}
