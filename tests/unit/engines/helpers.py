"""Fake engines behind ``httpx.MockTransport``, and builders for the engine tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import httpx

from proxy.config import EngineConfig, Settings
from proxy.engines import make_http_client
from tests.support.polling import wait_until as wait_until

METRICS_TEXT = (Path(__file__).parent / "data" / "vllm_v1_metrics.txt").read_text()

Responder = Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]]


def engine_config(name: str = "a", models: tuple[str, ...] = ()) -> EngineConfig:
    return EngineConfig(url=f"http://{name}.engine.test:8000", name=name, models=models)


def make_settings(*configs: EngineConfig, unhealthy_after: int = 2) -> Settings:
    return Settings.from_keys(
        engines=configs or (engine_config(),),
        unhealthy_after=unhealthy_after,
        health_interval_s=0.01,
        scrape_interval_s=0.01,
    )


class FakeEngines:
    """A MockTransport handler that routes by (host name, path) and records requests.

    The host name is the engine's name (see :func:`engine_config`); an unknown
    route answers 404.
    """

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Responder] = {}
        self.requests: list[httpx.Request] = []

    def on(self, engine: str, path: str, respond: Responder) -> None:
        self.routes[(engine, path)] = respond

    def calls(self, engine: str, path: str) -> int:
        host = f"{engine}.engine.test"
        return sum(1 for r in self.requests if r.url.host == host and r.url.path == path)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        engine = request.url.host.removesuffix(".engine.test")
        respond = self.routes.get((engine, request.url.path))
        if respond is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        response = respond(request)
        return response if isinstance(response, httpx.Response) else await response

    def client(self, settings: Settings | None = None) -> httpx.AsyncClient:
        return make_http_client(settings or make_settings(), httpx.MockTransport(self))


def refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("[Errno 111] Connection refused", request=request)


def answer(status: int = 200, **kwargs: object) -> Responder:
    """A responder that answers ``httpx.Response(status, **kwargs)``."""

    def respond(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, **kwargs)  # type: ignore[arg-type]

    return respond


class SlowStream(httpx.AsyncByteStream):
    """A response body: ``chunks``, then ``error`` if given, else nothing until closed.

    ``aclose`` passes a checkpoint before it records the close, so a close that is
    not shielded from cancellation is never recorded.
    """

    def __init__(self, chunks: list[bytes], error: Exception | None = None) -> None:
        self.chunks = chunks
        self.error = error
        self.sent = 0
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.sent += 1
            yield chunk
        if self.error is not None:
            raise self.error
        await anyio.sleep_forever()

    async def aclose(self) -> None:
        await anyio.lowlevel.checkpoint()
        self.closed = True
