"""The overhead benchmark's ``passthrough`` arm: the floor of the proxy's own stack.

uvicorn (uvloop, httptools) serving one Starlette route that forwards every
``POST /v1/...`` to the upstream through the proxy's own engine client (one
``httpx.AsyncClient`` on :class:`proxy.engines.PlainHTTPTransport`, httptools
parsing the upstream's answers) and streams the upstream's bytes back as they come
(Starlette's ``StreamingResponse``): no scheduling, no metrics, no parsing of the
events. What whoseturn costs above it is what its own work costs; what it costs
itself is what the framework and the client cost.

Run: ``python -m loadtests.bench.overhead_passthrough --port P --upstream URL``.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from proxy.config import settings_from_dict
from proxy.engines import make_http_client


def build_app(upstream: str) -> Starlette:
    """The passthrough app in front of ``upstream`` (its base URL, no ``/v1``)."""
    clients: list[httpx.AsyncClient] = []

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        settings = settings_from_dict({"engines": [{"url": upstream, "max_inflight": 4096}]})
        async with make_http_client(settings) as client:
            clients.append(client)
            yield

    async def forward(request: Request) -> StreamingResponse:
        client = clients[0]
        body = await request.body()
        headers = {"content-type": "application/json"}
        url = upstream + request.url.path
        sent = client.build_request("POST", url, content=body, headers=headers)
        answer = await client.send(sent, stream=True)
        media = answer.headers.get("content-type", "application/json")
        return StreamingResponse(
            answer.aiter_raw(), status_code=answer.status_code, media_type=media,
            background=BackgroundTask(answer.aclose),
        )  # fmt: skip

    async def health(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    routes = [Route("/v1/{path:path}", forward, methods=["POST"]), Route("/health", health)]
    return Starlette(routes=routes, lifespan=lifespan)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the upstream's base URL")
    args = parser.parse_args(argv)
    uvicorn.run(
        build_app(args.upstream.rstrip("/")), host="127.0.0.1", port=args.port,
        loop="uvloop", http="httptools", log_level="warning", access_log=False,
        backlog=4096,
    )  # fmt: skip


if __name__ == "__main__":
    main()
