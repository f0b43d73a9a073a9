"""The completion routes answered in front of FastAPI's stack.

Every chat and batch request, and every token it streams, used to pass through the
whole of FastAPI's stack: Starlette's error middleware, the proxy's own middleware,
FastAPI's exception and exit-stack layers, the router's match of every route, the
endpoint's wrappers, and three ``send`` wrappers per streamed event. None of it does
anything for these four routes that the proxy does not do itself
(docs/overhead.md, "The hot path"). :class:`CompletionFront` sits first inside
:class:`EdgeApp`: a ``POST`` to one of the completion routes (:data:`COMPLETION_ROUTES`
and their ``/batch`` twins) goes to a short chain of the proxy's own layers, the same
ones FastAPI's path runs, in the same order:

- :class:`~proxy.api.intake.Intake`: the request id, the body's limits, the last
  resort (an error nobody answered gets an OpenAI-shaped answer: an
  :class:`~proxy.openai.errors.APIError` its own, anything else a 500 with the id);
- :class:`~proxy.api.auth.KeyCheck`: the key, its role and its tenant;
- the endpoint: :meth:`proxy.api.forward.Forwarder.handle`, its response sent as is.

Everything else (other methods on these paths, other paths, the lifespan) goes to
FastAPI as before, and the routes stay registered there for the OpenAPI document.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.api.forward import Forwarder
from proxy.scheduler import TrafficClass

COMPLETION_ROUTES = ("/v1/chat/completions", "/v1/completions")
"""The interactive class's completion routes; each has a ``/batch`` twin."""

Route = tuple[str, TrafficClass]
"""A completion route's OpenAI path and its default class."""


def completion_routes() -> dict[str, Route]:
    """Each completion path the proxy serves, with its OpenAI path and class."""
    routes: dict[str, Route] = {}
    for path in COMPLETION_ROUTES:
        routes[path] = (path, TrafficClass.INTERACTIVE)
        routes["/batch" + path] = (path, TrafficClass.BATCH)
    return routes


def completion_endpoint(forwarder_of: Callable[[Request], Forwarder]) -> ASGIApp:
    """The completion routes as one raw ASGI endpoint: the request to the forwarder,
    its response sent as it comes back. An error raised goes to the layers around it
    (:class:`~proxy.api.intake.Intake`'s last resort answers it)."""
    routes = completion_routes()

    async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        path, cls = routes[route_path(scope)]
        request = Request(scope, receive, send)
        response = await forwarder_of(request).handle(request, path, cls)
        await response(scope, receive, send)

    return endpoint


def route_path(scope: Scope) -> str:
    """The path as the routes see it: without the app's ``root_path``, as Starlette's
    router matches it."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class CompletionFront:
    """ASGI: a ``POST`` to a completion route goes to ``hot`` (the proxy's layers and
    the endpoint), everything else to ``app`` (FastAPI's stack)."""

    def __init__(self, app: ASGIApp, hot: ASGIApp) -> None:
        self.app = app
        self.hot = hot
        self.paths = frozenset(completion_routes())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and route_path(scope) in self.paths
        ):
            await self.hot(scope, receive, send)
        else:
            await self.app(scope, receive, send)


class EdgeApp(FastAPI):
    """FastAPI, with the completion routes answered in front of its stack
    (:class:`CompletionFront`) once :meth:`answer_completions_first` gave the chain."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._hot: ASGIApp | None = None

    def answer_completions_first(self, hot: ASGIApp) -> None:
        """``hot`` answers the completion routes from now on (before the app starts)."""
        self._hot = hot

    def build_middleware_stack(self) -> ASGIApp:
        stack = super().build_middleware_stack()
        return stack if self._hot is None else CompletionFront(stack, self._hot)
