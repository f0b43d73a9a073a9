"""Streamed requests: what reaches the engine, errors, and closing on every exit."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
import httpx
import pytest

from proxy.engines import (
    EngineClient,
    EngineHTTPError,
    EngineStreamBroken,
    EngineUnavailable,
    UpstreamError,
    map_stream_error,
)
from proxy.engines._client import json_bytes

from .helpers import FakeEngines, SlowStream, answer, engine_config, refuse

pytestmark = pytest.mark.anyio

PATH = "/v1/chat/completions"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
EVENTS = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b'data: {"n": 3}\n\n']


@pytest.fixture
async def engine(fake: FakeEngines) -> AsyncIterator[EngineClient]:
    async with fake.client() as http:
        yield EngineClient(engine_config("a"), http)


def serve(fake: FakeEngines, stream: SlowStream) -> None:
    headers = {"content-type": "text/event-stream"}
    fake.on("a", PATH, answer(200, stream=stream, headers=headers))


async def test_posts_json_and_yields_the_open_response(
    fake: FakeEngines, engine: EngineClient
) -> None:
    stream = SlowStream(EVENTS)
    serve(fake, stream)
    async with engine.stream(PATH, BODY, {"X-Request-Id": "r-1"}) as response:
        assert response.status_code == 200
        chunks = []
        async for chunk in response.aiter_raw():
            chunks.append(chunk)
            if len(chunks) == len(EVENTS):
                break
    assert chunks == EVENTS
    sent = fake.requests[0]
    assert sent.url == "http://a.engine.test:8000/v1/chat/completions"
    assert json.loads(sent.content) == BODY
    assert sent.headers["x-request-id"] == "r-1"
    assert sent.headers["content-type"] == "application/json"
    assert sent.headers["accept-encoding"] == "identity"
    assert stream.closed


async def test_leaving_early_closes_the_response(fake: FakeEngines, engine: EngineClient) -> None:
    stream = SlowStream(EVENTS)
    serve(fake, stream)
    async with engine.stream(PATH, BODY) as response:
        assert response.status_code == 200
    assert stream.closed and stream.sent == 0


async def test_an_exception_in_the_block_closes_the_response(
    fake: FakeEngines, engine: EngineClient
) -> None:
    stream = SlowStream(EVENTS)
    serve(fake, stream)
    with pytest.raises(RuntimeError, match="client went away"):
        async with engine.stream(PATH, BODY) as response:
            async for _ in response.aiter_raw():
                raise RuntimeError("client went away")
    assert stream.closed


async def test_cancellation_closes_the_response(fake: FakeEngines, engine: EngineClient) -> None:
    stream = SlowStream(EVENTS)
    serve(fake, stream)
    with anyio.CancelScope() as scope:
        async with engine.stream(PATH, BODY) as response:
            async for _ in response.aiter_raw():
                if stream.sent == len(EVENTS):
                    scope.cancel()  # the engine now sends nothing; we are waiting
    assert scope.cancelled_caught
    assert stream.closed


async def test_cancelling_a_task_group_closes_the_response(
    fake: FakeEngines, engine: EngineClient
) -> None:
    """The shape of a proxied stream whose client hangs up."""
    stream = SlowStream(EVENTS)
    serve(fake, stream)
    first = anyio.Event()

    async def relay() -> None:
        async with engine.stream(PATH, BODY) as response:
            async for _ in response.aiter_raw():
                first.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(relay)
        await first.wait()
        tg.cancel_scope.cancel()
    assert stream.closed


@pytest.mark.parametrize("status", [400, 422, 500])
async def test_a_non_2xx_answer_raises_with_the_whole_body(
    fake: FakeEngines, engine: EngineClient, status: int
) -> None:
    body = b'{"error":{"message":"max_tokens is too large","type":"BadRequestError"}}'
    fake.on("a", PATH, answer(status, content=body, headers={"content-type": "application/json"}))
    with pytest.raises(EngineHTTPError) as caught:
        async with engine.stream(PATH, BODY):
            pytest.fail("a non-2xx answer must not be yielded")
    assert caught.value.status == status
    assert caught.value.body == body
    assert caught.value.content_type == "application/json"


async def test_a_refused_connection_is_unavailable(fake: FakeEngines, engine: EngineClient) -> None:
    fake.on("a", PATH, refuse)
    with pytest.raises(EngineUnavailable) as caught:
        async with engine.stream(PATH, BODY):
            pytest.fail("nothing to yield")
    assert isinstance(caught.value.__cause__, httpx.ConnectError)


async def test_a_read_error_while_iterating_is_the_callers_to_map(
    fake: FakeEngines, engine: EngineClient
) -> None:
    stream = SlowStream(EVENTS[:1], httpx.ReadError("connection reset by peer"))
    serve(fake, stream)
    with pytest.raises(EngineStreamBroken) as caught:
        async with engine.stream(PATH, BODY) as response:
            try:
                async for _ in response.aiter_raw():
                    pass
            except httpx.HTTPError as exc:
                raise map_stream_error(engine.name, exc) from exc
    assert caught.value.engine == "a"
    assert isinstance(caught.value.__cause__, httpx.ReadError)
    assert stream.closed


def test_map_stream_error() -> None:
    for error in (
        httpx.ReadError("reset"),
        httpx.ReadTimeout("timed out"),
        httpx.RemoteProtocolError("peer closed connection without sending complete message"),
        httpx.StreamClosed(),
    ):
        mapped = map_stream_error("a", error)
        assert isinstance(mapped, EngineStreamBroken)
        assert mapped.engine == "a"
        assert mapped.__cause__ is error
        assert type(error).__name__ in str(mapped)
    already = EngineUnavailable("b", "refused")
    assert map_stream_error("a", already) is already
    assert isinstance(map_stream_error("a", already), UpstreamError)


def test_the_upstream_body_is_what_httpx_json_would_send() -> None:
    """Compact UTF-8 JSON of the same value, including what orjson cannot encode (an
    integer beyond 64 bits). (Floats may be spelt differently: 1e-7 for 1e-07.)"""
    bodies: list[dict[str, object]] = [
        {"model": "m", "messages": [{"role": "user", "content": "x" * 100_000}]},
        {"prompt": "naïve café ☕ 𝄞", "temperature": 0.1, "top_p": 1e-7, "n": 2, "stop": None},
        {"seed": 2**70, "logit_bias": {"50256": -100}, "nested": [[1.5, True], {}]},
    ]
    for body in bodies:
        assert json.loads(json_bytes(body)) == body
    assert json_bytes({"a": [1, "é"]}) == '{"a":[1,"é"]}'.encode()
    assert json_bytes({"seed": 2**70}) == b'{"seed":1180591620717411303424}'
