"""Every input gets an answer in OpenAI's error shape, never a 5xx: the cases seen
in the field, then property tests over the request models and the whole app."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio.from_thread
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.types import Message

from proxy.openai.bodies import BodyError, check_completion, parse_json
from proxy.openai.request import affinity_key, prompt_text, upstream_body
from proxy.server import create_app

from .helpers import CHAT, COMPLETIONS, MESSAGES, FakeEngines, running

pytestmark = pytest.mark.anyio

Json = dict[str, Any]
ROUTES = [CHAT, COMPLETIONS, "/batch" + CHAT, "/batch" + COMPLETIONS]
JSON_TYPE = {"content-type": "application/json"}


def valid_body(route: str, **extra: Any) -> Json:
    if route.endswith(CHAT):
        return {"model": "m", "messages": MESSAGES, **extra}
    return {"model": "m", "prompt": "Say hello.", **extra}


def assert_openai_error(response: httpx.Response, status: int) -> Json:
    assert response.status_code == status, response.text
    error: Json = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


# -- the cases seen in the field, on every completion route ------------------------------

DEEP = b"[" * 1200 + b"]" * 1200
BAD_BODIES: list[tuple[str, bytes | Json, str | None]] = [
    ("messages not a list", {"messages": 5}, "messages"),
    ("prompt not a prompt", {"prompt": {"a": 1}}, "prompt"),
    ("NaN", b'{"model": "m", "temperature": NaN, %s}', None),
    ("Infinity", b'{"model": "m", "top_p": Infinity, %s}', None),
    ("1e400", b'{"model": "m", "max_tokens": 1e400, %s}', None),
    ("surrogate in text", b'{"model": "m", "user": "x\\ud800y", %s}', None),
    ("surrogate in model", b'{"model": "x\\udc00", %s}', None),
    ("deep nesting", b'{"model": "m", "x": ' + DEEP + b", %s}", None),
    ("stream as a string", {"stream": "false"}, "stream"),
    ("stream_options without stream", {"stream_options": {"include_usage": True}}, None),
    ("include_usage as a string", {"stream": True, "stream_options": {"include_usage": "y"}}, None),
    ("model missing", {"model": None}, "model"),
    ("model empty", {"model": ""}, "model"),
    ("model a number", {"model": 3}, "model"),
]


def bad_raw(route: str, bad: bytes | Json) -> bytes:
    if isinstance(bad, dict):
        body = valid_body(route, **bad)
        return json.dumps({k: v for k, v in body.items() if v is not None}).encode()
    field = b'"messages": []' if route.endswith(CHAT) else b'"prompt": "p"'
    if route.endswith(CHAT):
        field = b'"messages": [{"role": "user", "content": "hi"}]'
    return bad.replace(b"%s", field)


def applies(route: str, bad: bytes | Json) -> bool:
    """``messages`` is read on the chat routes only, ``prompt`` on the others."""
    other = "prompt" if route.endswith(CHAT) else "messages"
    return not isinstance(bad, dict) or other not in bad


BAD_CASES = [
    pytest.param(route, *case, id=f"{case[0]} on {route}")
    for route in ROUTES
    for case in BAD_BODIES
    if applies(route, case[1])
]


@pytest.mark.parametrize(("route", "case", "bad", "param"), BAD_CASES)
async def test_bad_body_is_a_400_and_never_reaches_an_engine(
    route: str, case: str, bad: bytes | Json, param: str | None
) -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post(route, content=bad_raw(route, bad), headers=JSON_TYPE)
    error = assert_openai_error(response, 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    assert engines.calls == [] or all(c.path not in (CHAT, COMPLETIONS) for c in engines.calls)


@pytest.mark.parametrize("route", ROUTES)
async def test_stream_options_without_stream_as_vllm_answers_it(route: str) -> None:
    engines = FakeEngines()
    body = valid_body(route, stream_options={"include_usage": True})
    async with running(engines.settings(), engines) as (client, _):
        refused = await client.post(route, json=body)
        empty = await client.post(route, json={**body, "stream_options": None})
    error = assert_openai_error(refused, 400)
    assert error["param"] == "stream_options"
    assert "stream=True" in error["message"]
    assert empty.status_code == 200


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
async def test_a_body_not_declared_json_is_415(content_type: str | None) -> None:
    engines = FakeEngines()
    raw = json.dumps(valid_body(CHAT)).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post(CHAT, content=raw, headers=headers)
    assert assert_openai_error(response, 415)["code"] == "unsupported_media_type"
    assert engines.seen(CHAT) == []


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/", 404),
        ("POST", "/v1/embeddings", 404),
        ("GET", "/v1/fine_tuning/jobs", 404),
        ("PUT", "/v1/batches", 405),
        ("GET", "/v1/x\u00e9", 404),
        ("GET", CHAT, 405),
        ("DELETE", "/v1/models", 405),
    ],
)
async def test_unknown_routes_and_methods_are_openai_shaped(
    method: str, path: str, status: int
) -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        response = await client.request(method, path)
    error = assert_openai_error(response, status)
    assert error["code"] == {404: "route_not_found", 405: "method_not_allowed"}[status]
    if status == 405:
        assert "allow" in response.headers


async def test_a_bad_query_parameter_is_an_openai_422_without_internals() -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        response = await client.get("/turn/log", params={"limit": "lots"})
    error = assert_openai_error(response, 422)
    assert error["param"] == "limit"
    assert "File" not in error["message"] and "lots" not in error["message"]


async def test_an_unexpected_error_is_an_openai_500_logged_once_without_the_body(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    engines = FakeEngines()
    secret = "my secret prompt text"
    async with running(engines.settings(), engines) as (client, state):

        async def broken(*_: Any) -> None:
            raise RuntimeError("something the proxy did not expect")

        monkeypatch.setattr(state.forwarder, "handle", broken)
        body = {"model": "m", "messages": [{"role": "user", "content": secret}]}
        with caplog.at_level(logging.DEBUG):
            response = await client.post(CHAT, json=body)
    error = assert_openai_error(response, 500)
    request_id = response.headers["x-request-id"]
    assert error["code"] == request_id and request_id in error["message"]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and request_id in errors[0].getMessage()
    assert secret not in caplog.text


async def test_a_client_leaving_mid_body_is_no_error_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engines = FakeEngines()
    app = create_app(engines.settings(), transport=httpx.MockTransport(engines))
    messages: list[Message] = [
        {"type": "http.request", "body": b'{"model": "m", "mess', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json")]
    scope = {"type": "http", "method": "POST", "path": CHAT, "headers": headers}
    scope |= {"query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1"}
    async with app.router.lifespan_context(app):
        with caplog.at_level(logging.DEBUG):
            await app(scope | {"app": app, "state": {}}, receive, send)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert engines.seen(CHAT) == []


# -- body size ------------------------------------------------------------------------


async def test_a_body_declared_too_large_is_413_unread() -> None:
    engines = FakeEngines()
    async with running(engines.settings(max_body_bytes=4096), engines) as (client, _):
        headers = {**JSON_TYPE, "content-length": "5000"}
        response = await client.post(CHAT, content=b"x" * 5000, headers=headers)
    error = assert_openai_error(response, 413)
    assert error["code"] == "request_too_large" and "4096" in error["message"]


async def test_a_streamed_body_is_cut_off_at_the_limit() -> None:
    engines = FakeEngines()
    pulled: list[int] = []

    async def chunks() -> Any:
        for i in range(100):  # 100 KiB, without a Content-Length
            pulled.append(i)
            yield b" " * 1024

    async with running(engines.settings(max_body_bytes=8192), engines) as (client, _):
        response = await client.post(CHAT, content=chunks(), headers=JSON_TYPE)
    assert_openai_error(response, 413)
    assert len(pulled) < 20  # not read in full
    assert engines.seen(CHAT) == []


async def test_a_body_at_the_limit_is_served() -> None:
    engines = FakeEngines()
    body = valid_body(CHAT)
    raw = json.dumps(body).encode()
    raw = raw[:-1] + b" " * (4096 - len(raw)) + b"}"
    async with running(engines.settings(max_body_bytes=4096), engines) as (client, _):
        response = await client.post(CHAT, content=raw, headers=JSON_TYPE)
    assert len(raw) == 4096 and response.status_code == 200


async def test_a_batch_upload_has_the_files_limit_not_the_body_limit(tmp_path: Path) -> None:
    """An input file over ``max_body_bytes`` but within ``batch_max_file_bytes`` is
    taken; a completion body of that size is not; an upload over the file limit is."""
    engines = FakeEngines()
    line = json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": valid_body(CHAT)})
    data = ((line + "\n") * 200).encode()
    limits = {"max_body_bytes": 4096, "batch_max_file_bytes": len(data) + 10}
    config = engines.settings(batch_store_path=str(tmp_path / "b.db"), **limits)
    async with running(config, engines) as (client, _):
        files = {"file": ("in.jsonl", data)}
        taken = await client.post("/v1/files", files=files, data={"purpose": "batch"})
        refused = await client.post(CHAT, content=data, headers=JSON_TYPE)
        bigger = {"file": ("in.jsonl", data * 2)}
        too_big = await client.post("/v1/files", files=bigger, data={"purpose": "batch"})
    assert len(data) > 4096 and taken.status_code == 200 and taken.json()["bytes"] == len(data)
    assert_openai_error(refused, 413)
    assert_openai_error(too_big, 413)


# -- properties -------------------------------------------------------------------------

# Text with every code point, lone surrogates included.
TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | TEXT
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]) | ANY_JSON},
    optional={
        "content": TEXT | ANY_JSON | st.lists(st.fixed_dictionaries({"type": TEXT, "text": TEXT})),
        "name": ANY_JSON,
    },
)
PROMPT = TEXT | st.lists(TEXT) | st.lists(st.integers()) | st.lists(st.lists(st.integers()))
BODIES = (
    st.fixed_dictionaries(
        {},
        optional={
            "model": st.just("m") | ANY_JSON,
            "messages": st.lists(MESSAGE, max_size=3) | ANY_JSON,
            "prompt": PROMPT | ANY_JSON,
            "stream": st.booleans() | ANY_JSON,
            "stream_options": st.fixed_dictionaries({}, optional={"include_usage": ANY_JSON})
            | ANY_JSON,
            "user": TEXT | ANY_JSON,
            "priority": ANY_JSON,
            "temperature": ANY_JSON,
        },
    )
    | ANY_JSON
)

SAFE_TEXT = st.text(max_size=12)
GOOD_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"])},
    optional={"content": SAFE_TEXT | st.none(), "name": SAFE_TEXT},
)
# Requests both routes accept, with the optional fields the proxy reads varied.
NEAR_VALID = st.fixed_dictionaries(
    {
        "model": st.just("m"),
        "messages": st.lists(GOOD_MESSAGE, min_size=1, max_size=3),
        "prompt": SAFE_TEXT | st.lists(st.integers(0, 1000), max_size=4),
    },
    optional={
        "stream": st.booleans(),
        "user": SAFE_TEXT,
        "max_tokens": st.integers(1, 16),
        "temperature": st.floats(0, 2),
        "priority": st.integers(-10, 10),
    },
)


def raw_json(body: Any) -> bytes:
    """``body`` as a client might send it: NaN and lone surrogates written as JSON
    tokens and escapes, as ``json.dumps`` does."""
    return json.dumps(body).encode()


@settings(max_examples=1000, deadline=None)
@given(body=NEAR_VALID | BODIES, chat=st.booleans())
def test_models_refuse_only_with_a_body_error_and_what_they_accept_can_be_forwarded(
    body: Any, chat: bool
) -> None:
    try:
        checked = check_completion(parse_json(raw_json(body)), chat=chat)
    except BodyError as exc:
        assert exc.message
        return
    text = prompt_text(checked)
    affinity_key(checked, text)
    json.dumps(upstream_body(checked, 5), allow_nan=False).encode()  # what httpx will send
    assert isinstance(checked["model"], str) and checked["model"]


@contextmanager
def proxy_in_thread() -> Iterator[tuple[anyio.from_thread.BlockingPortal, httpx.AsyncClient]]:
    """One proxy for many examples: its lifespan runs in a portal's event loop."""
    engines = FakeEngines()
    with anyio.from_thread.start_blocking_portal() as portal:
        cm = portal.wrap_async_context_manager(running(engines.settings(), engines))
        with cm as (client, _):
            yield portal, client


@pytest.mark.timeout(120)
def test_no_generated_body_gets_a_5xx_on_any_route() -> None:
    seen: dict[int, int] = {}
    with proxy_in_thread() as (portal, client):

        @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(body=NEAR_VALID | BODIES, route=st.sampled_from(ROUTES))
        def check(body: Any, route: str) -> None:
            response = portal.call(
                lambda: client.post(route, content=raw_json(body), headers=JSON_TYPE)
            )
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code in (200, 400, 404), response.text
            if response.status_code != 200:
                assert_openai_error(response, response.status_code)

        check()
    print(f"statuses over {sum(seen.values())} generated requests: {seen}")
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0  # both sides were reached


class TokenizeRefuses(FakeEngines):
    """Engines whose ``/tokenize`` answers ``status``."""

    def __init__(self, status: int) -> None:
        super().__init__()
        self.status = status
        self.asked = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            self.asked += 1
            return httpx.Response(self.status, json={"error": {"message": "no"}})
        return await super().__call__(request)


@pytest.mark.parametrize(("status", "warned"), [(400, False), (500, True)])
async def test_a_prompt_the_engine_cannot_count_is_estimated_and_warned_only_if_not_the_clients(
    caplog: pytest.LogCaptureFixture, status: int, warned: bool
) -> None:
    engines = TokenizeRefuses(status)
    async with running(engines.settings(), engines) as (client, _):
        with caplog.at_level(logging.DEBUG):
            response = await client.post("/batch" + CHAT, json=valid_body(CHAT))
    assert response.status_code == 200
    assert engines.asked == 1
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert bool(warnings) is warned
    assert "tokenize failed" in caplog.text
