"""The completion routes are answered in front of FastAPI's stack; nothing else is."""

from __future__ import annotations

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from proxy.api.front import CompletionFront, EdgeApp, completion_routes, route_path
from proxy.scheduler import TrafficClass

pytestmark = pytest.mark.anyio


class Recorder:
    """An ASGI app that answers its name and records the paths it saw."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[tuple[str, str]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.seen.append((scope["method"], scope["path"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": self.name.encode()})


async def answered_by(app: object, method: str, path: str, root_path: str = "") -> str:
    transport = httpx.ASGITransport(app=app, root_path=root_path)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        response = await client.request(method, root_path + path, json={})
    return response.text


def test_each_completion_route_has_its_path_and_class() -> None:
    routes = completion_routes()
    assert routes["/v1/chat/completions"] == ("/v1/chat/completions", TrafficClass.INTERACTIVE)
    assert routes["/batch/v1/completions"] == ("/v1/completions", TrafficClass.BATCH)
    assert len(routes) == 4


async def test_a_post_to_a_completion_route_goes_in_front_and_nothing_else_does() -> None:
    hot, stack = Recorder("hot"), Recorder("stack")
    front = CompletionFront(stack, hot)
    for path in completion_routes():
        assert await answered_by(front, "POST", path) == "hot"
    assert await answered_by(front, "GET", "/v1/chat/completions") == "stack"
    assert await answered_by(front, "POST", "/v1/chat/completions/") == "stack"
    assert await answered_by(front, "POST", "/v1/batches") == "stack"
    assert await answered_by(front, "POST", "/v1/embeddings") == "stack"
    # behind a root path, as Starlette's router matches it
    assert await answered_by(front, "POST", "/v1/completions", root_path="/llm") == "hot"
    assert hot.seen[-1] == ("POST", "/llm/v1/completions")


def test_route_path_drops_the_root_path() -> None:
    assert route_path({"path": "/llm/v1/completions", "root_path": "/llm"}) == "/v1/completions"
    assert route_path({"path": "/v1/completions", "root_path": ""}) == "/v1/completions"


async def test_an_edge_app_without_a_front_is_fastapi_as_it_is() -> None:
    app = EdgeApp()

    @app.post("/v1/chat/completions")
    async def chat() -> str:
        return "fastapi"

    assert await answered_by(app, "POST", "/v1/chat/completions") == '"fastapi"'
    fronted = EdgeApp()
    fronted.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    fronted.answer_completions_first(Recorder("hot"))
    assert await answered_by(fronted, "POST", "/v1/chat/completions") == "hot"
    assert await answered_by(fronted, "GET", "/v1/chat/completions") != "hot"  # FastAPI's 405
