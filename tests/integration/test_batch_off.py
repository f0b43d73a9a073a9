"""With the Batch API off, the official ``openai`` client gives up at once: the
Files and Batch routes answer 404 (``invalid_request_error``, saying how to turn
the API on), as OpenAI answers what a caller cannot use, and the SDK retries no
4xx but 408, 409 and 429. A 503 would be retried twice, with backoff, before the
user saw why. Counted at the proxy: one request per call."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.config import settings_from_dict
from proxy.server import create_app
from tests.support.served import serving

from .proxyserver import PROXY_DEFAULTS, engine
from .simserver import SimServer

pytestmark = pytest.mark.integration


@dataclass
class Counted:
    """An ASGI app that notes each HTTP request it is given."""

    app: ASGIApp
    seen: list[str] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.seen.append(f"{scope['method']} {scope['path']}")
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def proxy(shared_sim: SimServer) -> Iterator[tuple[str, Counted]]:
    """The proxy with the Batch API turned off (it is on by default)."""
    off = {**PROXY_DEFAULTS, "batch_store": "off"}
    settings = settings_from_dict({**off, "engines": [engine(shared_sim.base_url, "e")]})
    counted = Counted(create_app(settings))
    with serving(counted, "the proxy") as (base_url, _, _):
        yield base_url, counted


CALLS: dict[str, Callable[[openai.OpenAI], Any]] = {
    "files.create": lambda c: c.files.create(file=("in.jsonl", b"{}\n"), purpose="batch"),
    "files.list": lambda c: c.files.list(),
    "files.retrieve": lambda c: c.files.retrieve("file-1"),
    "files.content": lambda c: c.files.content("file-1"),
    "files.delete": lambda c: c.files.delete("file-1"),
    "batches.create": lambda c: c.batches.create(
        input_file_id="file-1", endpoint="/v1/chat/completions", completion_window="24h"
    ),
    "batches.list": lambda c: c.batches.list(),
    "batches.retrieve": lambda c: c.batches.retrieve("batch_1"),
    "batches.cancel": lambda c: c.batches.cancel("batch_1"),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_the_sdk_stops_at_once_and_says_why(proxy: tuple[str, Counted], call: str) -> None:
    base_url, counted = proxy
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=2)
    before = len(counted.seen)
    started = time.monotonic()
    with client, pytest.raises(openai.NotFoundError) as raised:
        CALLS[call](client)
    assert len(counted.seen) - before == 1, counted.seen[before:]  # no retry
    assert time.monotonic() - started < 2  # no backoff waited (the SDK's first is 0.5 s+)
    error = raised.value
    assert error.status_code == 404
    assert isinstance(error.body, dict)
    assert (error.body["type"], error.body["code"]) == ("invalid_request_error", "batch_api_off")
    assert "batch_store: sqlite" in error.message and "batch_dsn" in error.message
