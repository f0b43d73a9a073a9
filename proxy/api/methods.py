"""Which methods a path allows, as HTTP wants them told (RFC 9110):

- a 405 lists in ``Allow`` every method the path allows, whichever route (FastAPI
  keeps one per method) answered it (:func:`allowed_methods`);
- every ``GET`` route answers ``HEAD`` as it answers ``GET``, without the body
  (:class:`HeadAsGet`; FastAPI's routes, unlike Starlette's, do not).
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def allowed_methods(routes: Sequence[BaseRoute], scope: Scope) -> list[str]:
    """The methods the routes matching ``scope``'s path allow, sorted; ``HEAD``
    wherever ``GET`` is."""
    methods: set[str] = set()
    for route in routes:
        match, _ = route.matches(scope)
        allowed = getattr(route, "methods", None)
        if match is not Match.NONE and allowed:
            methods.update(allowed)
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


class HeadAsGet:
    """ASGI middleware: a ``HEAD`` to a path with a ``GET`` route runs as that ``GET``
    (keys, limits and headers alike: ``Content-Length`` is the ``GET``'s) and its body
    is dropped. Any other ``HEAD`` goes on as it came (a 404 or a 405)."""

    def __init__(self, app: ASGIApp, *, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        as_get = {**scope, "method": "GET"}
        if "GET" not in allowed_methods(self.routes, as_get):
            await self.app(scope, receive, send)
            return

        async def without_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app(as_get, receive, without_body)
