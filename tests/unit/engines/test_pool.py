"""The engine pool: lookup, model discovery, and the shared client it is given."""

from __future__ import annotations

import logging

import anyio
import httpx
import pytest

from proxy.engines import EnginePool, make_http_client
from proxy.engines._pool import ShardedTransport

from .helpers import FakeEngines, answer, engine_config, make_settings, refuse


def cards(*ids: str) -> dict[str, object]:
    return {"object": "list", "data": [{"id": i, "object": "model"} for i in ids]}


@pytest.mark.anyio
async def test_engines_by_name_in_config_order() -> None:
    async with FakeEngines().client() as http:
        pool = EnginePool([engine_config("b"), engine_config("a")], http)
        assert list(pool.engines) == ["b", "a"]
        assert pool.client_for("a").url == "http://a.engine.test:8000"
        assert pool.client_for("a").config.name == "a"
        with pytest.raises(KeyError, match="no engine named 'c'"):
            pool.client_for("c")
        with pytest.raises(ValueError, match="unique"):
            EnginePool([engine_config("a"), engine_config("a")], http)


@pytest.mark.anyio
async def test_discover_asks_only_unconfigured_engines_and_tolerates_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeEngines()
    fake.on("a", "/v1/models", answer(json=cards("never-asked")))
    fake.on("b", "/v1/models", answer(json=cards("tiny", "small")))
    fake.on("c", "/v1/models", refuse)
    fake.on("d", "/v1/models", answer(503, text="loading"))
    configs = [engine_config("a", models=("configured",))]
    configs += [engine_config(n) for n in "bcd"]
    caplog.set_level(logging.WARNING, logger="proxy.engines")
    async with fake.client() as http:
        found = await EnginePool(configs, http).discover()
    assert found == {"a": ("configured",), "b": ("tiny", "small"), "c": (), "d": ()}
    assert list(found) == ["a", "b", "c", "d"]
    assert fake.calls("a", "/v1/models") == 0
    warned = {r.getMessage().split(":")[0] for r in caplog.records if r.levelname == "WARNING"}
    assert warned == {"engine c", "engine d"}


@pytest.mark.anyio
async def test_discover_asks_engines_concurrently() -> None:
    fake = FakeEngines()
    arrived = 0
    all_arrived = anyio.Event()

    async def respond(request: httpx.Request) -> httpx.Response:
        nonlocal arrived
        arrived += 1
        if arrived == 2:
            all_arrived.set()
        await all_arrived.wait()  # one at a time would wait here forever
        return httpx.Response(200, json=cards(request.url.host.split(".")[0]))

    fake.on("a", "/v1/models", respond)
    fake.on("b", "/v1/models", respond)
    async with fake.client() as http:
        with anyio.fail_after(5):
            found = await EnginePool([engine_config("a"), engine_config("b")], http).discover()
    assert found == {"a": ("a",), "b": ("b",)}


@pytest.mark.anyio
async def test_make_http_client_settings() -> None:
    settings = make_settings()
    async with make_http_client(settings) as http:
        assert http.timeout.connect == settings.upstream.connect_timeout_s
        assert http.timeout.read is None
        assert http.timeout.pool is None
        assert http.headers["accept-encoding"] == "identity"
        assert http.trust_env is False


@pytest.mark.anyio
async def test_the_sharded_transport_spreads_requests_over_its_pools_in_turn() -> None:
    """Each pool takes every n-th request (so each holds a share of the connections),
    and closing the client closes every pool."""
    seen: list[int] = []
    closed: list[int] = []

    class Shard(httpx.MockTransport):
        def __init__(self, n: int) -> None:
            super().__init__(lambda request: (seen.append(n), httpx.Response(200))[1])
            self.n = n

        async def aclose(self) -> None:
            closed.append(self.n)

    async with httpx.AsyncClient(transport=ShardedTransport([Shard(i) for i in range(3)])) as c:
        for _ in range(7):
            assert (await c.get("http://e:1/health")).status_code == 200
    assert sorted(seen[:3]) == [0, 1, 2] and seen[3:6] == seen[:3] and len(seen) == 7
    assert sorted(closed) == [0, 1, 2]


@pytest.mark.anyio
async def test_a_connection_gone_while_it_was_set_up_is_a_connect_error() -> None:
    """anyio on uvloop raises AttributeError for a socket the peer closed during
    connection setup; the client sees httpx.ConnectError (nothing was sent)."""

    class Closing(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            raise AttributeError("'NoneType' object has no attribute 'getpeername'")

    async with httpx.AsyncClient(transport=ShardedTransport([Closing()])) as c:
        with pytest.raises(httpx.ConnectError, match="closed while it was being set up"):
            await c.get("http://e:1/health")
