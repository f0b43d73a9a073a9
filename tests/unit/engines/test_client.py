"""One engine's control calls and the mapping of their failures."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from proxy.engines import (
    EngineBadResponse,
    EngineClient,
    EngineHTTPError,
    EngineStreamBroken,
    EngineUnavailable,
    UpstreamError,
)
from proxy.scheduler import EngineLoad

from .helpers import METRICS_TEXT, FakeEngines, SlowStream, answer, engine_config, refuse

pytestmark = pytest.mark.anyio

Call = Callable[[EngineClient], Awaitable[object]]


@pytest.fixture
async def engine(fake: FakeEngines) -> AsyncIterator[EngineClient]:
    async with fake.client() as http:
        yield EngineClient(engine_config("a"), http, token_cache_size=2)


async def test_models_lists_the_ids(fake: FakeEngines, engine: EngineClient) -> None:
    cards = {"object": "list", "data": [{"id": "tiny", "object": "model"}, {"id": "lora-1"}]}
    fake.on("a", "/v1/models", answer(json=cards))
    assert await engine.models() == ["tiny", "lora-1"]


async def test_load_reads_metrics(fake: FakeEngines, engine: EngineClient) -> None:
    fake.on("a", "/metrics", answer(text=METRICS_TEXT))
    assert await engine.load() == EngineLoad(kv_usage=0.625, waiting=7, running=7)


@pytest.mark.parametrize(
    ("respond", "healthy"),
    [
        (answer(200), True),
        (answer(503), False),
        (refuse, False),
        (answer(200, stream=SlowStream([b""], httpx.ReadTimeout("timed out"))), False),
    ],
    ids=["200", "503", "refused", "read-timeout"],
)
async def test_health_never_raises(
    fake: FakeEngines, engine: EngineClient, respond: Any, healthy: bool
) -> None:
    fake.on("a", "/health", respond)
    assert await engine.health() is healthy


# -- token counts --------------------------------------------------------------------


def tokenizer(fake: FakeEngines, count: int = 5) -> list[dict[str, Any]]:
    """Answer /tokenize with ``count``; returns the bodies it receives."""
    bodies: list[dict[str, Any]] = []

    def respond(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"count": count, "max_model_len": 2048, "tokens": []})

    fake.on("a", "/tokenize", respond)
    return bodies


async def test_count_tokens_asks_tokenize(fake: FakeEngines, engine: EngineClient) -> None:
    bodies = tokenizer(fake)
    messages = [{"role": "user", "content": "hi"}]
    assert await engine.count_tokens("tiny", prompt="hello") == 5
    assert await engine.count_tokens("tiny", messages=messages) == 5
    assert bodies == [{"model": "tiny", "prompt": "hello"}, {"model": "tiny", "messages": messages}]


async def test_a_cached_count_makes_no_second_call(fake: FakeEngines, engine: EngineClient) -> None:
    bodies = tokenizer(fake)
    for _ in range(3):
        assert await engine.count_tokens("tiny", prompt="hello") == 5
    assert len(bodies) == 1
    await engine.count_tokens("other-model", prompt="hello")
    await engine.count_tokens("tiny", messages=[{"role": "user", "content": "hello"}])
    assert len(bodies) == 3


async def test_the_cache_is_bounded_and_evicts_the_least_recent(
    fake: FakeEngines, engine: EngineClient
) -> None:
    bodies = tokenizer(fake)
    for prompt in ("one", "two", "one", "three", "one", "two"):
        await engine.count_tokens("tiny", prompt=prompt)
    # size 2: "two" was evicted by "three", "one" stayed as it was used last
    assert [b["prompt"] for b in bodies] == ["one", "two", "three", "two"]
    assert len(engine.token_cache) == 2


async def test_token_ids_count_without_a_call(fake: FakeEngines, engine: EngineClient) -> None:
    assert await engine.count_tokens("tiny", prompt=[1, 2, 3]) == 3
    assert fake.requests == []


async def test_a_batch_of_prompts_counts_as_the_sum(
    fake: FakeEngines, engine: EngineClient
) -> None:
    bodies = tokenizer(fake, count=5)
    assert await engine.count_tokens("tiny", prompt=["one", "two"]) == 10
    assert await engine.count_tokens("tiny", prompt=[[1, 2], [3, 4, 5]]) == 5
    assert await engine.count_tokens("tiny", prompt=["one"]) == 5  # cached per prompt
    assert [b["prompt"] for b in bodies] == ["one", "two"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"prompt": "a", "messages": []},
        {"prompt": 42},
        {"prompt": ["text", 3]},
        {"prompt": [[1, "2"]]},
        {"prompt": [True, False]},
        {"messages": "hello"},
    ],
    ids=repr,
)
async def test_count_tokens_refuses_what_is_not_a_prompt(
    fake: FakeEngines, engine: EngineClient, kwargs: dict[str, Any]
) -> None:
    tokenizer(fake)
    with pytest.raises(ValueError, match=r"prompt|messages"):
        await engine.count_tokens("tiny", **kwargs)
    assert fake.requests == []


async def test_a_tokenize_answer_without_count_is_bad(
    fake: FakeEngines, engine: EngineClient
) -> None:
    fake.on("a", "/tokenize", answer(json={"tokens": [1, 2]}))
    with pytest.raises(EngineBadResponse, match="/tokenize"):
        await engine.count_tokens("tiny", prompt="x")
    assert len(engine.token_cache) == 0


# -- failures of control calls --------------------------------------------------------

CALLS: dict[str, tuple[str, Call]] = {
    "models": ("/v1/models", lambda e: e.models()),
    "load": ("/metrics", lambda e: e.load()),
    "count_tokens": ("/tokenize", lambda e: e.count_tokens("tiny", prompt="x")),
}


@pytest.fixture(params=sorted(CALLS))
def call(request: pytest.FixtureRequest) -> tuple[str, Call]:
    return CALLS[request.param]


@pytest.mark.parametrize(
    "error",
    [
        httpx.ConnectError("[Errno 111] Connection refused"),
        httpx.ConnectTimeout("timed out"),
        httpx.RemoteProtocolError("Server disconnected without sending a response."),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_no_response_is_unavailable(
    fake: FakeEngines, engine: EngineClient, call: tuple[str, Call], error: Exception
) -> None:
    path, do = call

    def respond(request: httpx.Request) -> httpx.Response:
        raise error

    fake.on("a", path, respond)
    with pytest.raises(EngineUnavailable) as caught:
        await do(engine)
    assert caught.value.engine == "a"
    assert caught.value.__cause__ is error


@pytest.mark.parametrize("status", [400, 404, 500, 503])
async def test_a_non_2xx_answer_keeps_status_and_body(
    fake: FakeEngines, engine: EngineClient, call: tuple[str, Call], status: int
) -> None:
    path, do = call
    body = b'{"error": {"message": "no", "type": "BadRequestError", "param": null, "code": 400}}'
    fake.on("a", path, answer(status, content=body, headers={"content-type": "application/json"}))
    with pytest.raises(EngineHTTPError) as caught:
        await do(engine)
    assert (caught.value.status, caught.value.body) == (status, body)
    assert caught.value.content_type == "application/json"
    assert caught.value.engine == "a"


async def test_a_read_error_mid_body_is_a_broken_stream(
    fake: FakeEngines, engine: EngineClient, call: tuple[str, Call]
) -> None:
    path, do = call
    stream = SlowStream([b'{"da'], httpx.ReadError("connection reset"))
    fake.on("a", path, answer(200, stream=stream))
    with pytest.raises(EngineStreamBroken):
        await do(engine)
    assert stream.closed


@pytest.mark.parametrize("name", ["models", "count_tokens"])
async def test_a_body_that_is_not_json_is_bad(
    fake: FakeEngines, engine: EngineClient, name: str
) -> None:
    path, do = CALLS[name]
    fake.on("a", path, answer(200, text="<html>hello</html>"))
    with pytest.raises(EngineBadResponse, match=path):
        await do(engine)


async def test_unparsable_metrics_are_bad(fake: FakeEngines, engine: EngineClient) -> None:
    fake.on("a", "/metrics", answer(200, text="<html>Bad Gateway</html>"))
    with pytest.raises(EngineBadResponse, match="/metrics"):
        await engine.load()


def test_every_error_is_an_upstream_error() -> None:
    for cls in (EngineUnavailable, EngineHTTPError, EngineStreamBroken, EngineBadResponse):
        assert issubclass(cls, UpstreamError)
    error = EngineHTTPError("a", 429, b"slow down", "text/plain")
    assert str(error) == "a: HTTP 429"
