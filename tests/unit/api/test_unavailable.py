"""Honest unavailability: a model that unreachable engines may serve gets 503
naming them and why, not 404; ``/batch/v1/models`` mirrors ``/v1/models``."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from .helpers import CHAT, MESSAGES, FakeEngines, running

pytestmark = pytest.mark.anyio

BODY = {"model": "m", "messages": MESSAGES}


class Unreachable(FakeEngines):
    """Fake engines, of which those named in ``down`` refuse every connection."""

    def __init__(self, **models: list[str]) -> None:
        super().__init__(**models)
        self.down: set[str] = set()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.host.removesuffix(".engine.test") in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        return await super().__call__(request)


def assert_503(response: httpx.Response) -> str:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "service_unavailable"
    assert int(response.headers["retry-after"]) >= 1
    message: str = error["message"]
    return message


@pytest.mark.parametrize("route", [CHAT, "/batch" + CHAT])
async def test_a_model_nobody_could_list_is_503_naming_the_unreached_engine(route: str) -> None:
    engines = Unreachable(a=["m"], b=["other"])
    engines.down = {"a"}
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post(route, json=BODY)
        unknown = await client.post(route, json={**BODY, "model": "other"})
    message = assert_503(response)
    assert "`m`" in message and "a (" in message and "health check" in message
    assert "b (" not in message
    assert unknown.status_code == 200  # b is up and serves it


async def test_a_configured_model_on_an_ejected_engine_is_503_with_the_reason() -> None:
    engines = Unreachable(a=["m"])
    settings: Any = engines.settings(
        engines=(engines.config("a", models=("m",)),), unhealthy_after=1, health_interval_s=600
    )
    engines.down = {"a"}
    async with running(settings, engines) as (client, _):
        response = await client.post(CHAT, json=BODY)
    message = assert_503(response)
    assert "No engine serving `m` is up" in message
    assert "a (ejected: 1 health checks failed in a row)" in message


async def test_a_model_no_reachable_engine_lists_is_still_404_when_all_were_asked() -> None:
    engines = Unreachable(a=["m"])
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post(CHAT, json={**BODY, "model": "gpt-9"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


async def test_batch_models_mirror_the_models() -> None:
    engines = FakeEngines(a=["m"], b=["n", "m"])
    async with running(engines.settings(), engines) as (client, _):
        plain = await client.get("/v1/models")
        batch = await client.get("/batch/v1/models")
    assert batch.status_code == 200
    assert batch.json() == plain.json()
    assert [card["id"] for card in batch.json()["data"]] == ["m", "n"]
