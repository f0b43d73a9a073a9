"""What the proxy reads from a request: its JSON, class, conversation, size, wishes;
and who sent it (the key check, :mod:`proxy.api.auth`)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi import Request
from starlette.types import Message

from proxy.api.auth import Caller, bearer_token, check_key
from proxy.api.inputs import CLASS_HEADER, read_json, traffic_class
from proxy.api.prompts import TokenEstimator
from proxy.config import EngineConfig, Settings
from proxy.openai.errors import APIError
from proxy.openai.request import StreamWish, affinity_key, prompt_text, stream_wish, upstream_body
from proxy.scheduler import TrafficClass

I, B = TrafficClass.INTERACTIVE, TrafficClass.BATCH  # noqa: E741 - read as class names


def request(body: bytes = b"", /, **headers: str) -> Request:
    async def receive() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    raw = [(k.replace("_", "-").lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw}, receive)


def settings(**fields: Any) -> Settings:
    return Settings.from_keys(engines=(EngineConfig(url="http://e:1", name="e"),), **fields)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def checked(settings: Settings, **headers: str) -> Caller | APIError:
    """The key check of a chat request with ``headers``."""
    return check_key(settings, request(**headers).scope)


def caller(settings: Settings, **headers: str) -> Caller:
    found = checked(settings, **headers)
    assert isinstance(found, Caller), found
    return found


def classed(default: TrafficClass, s: Settings, **headers: str) -> TrafficClass:
    """The class of a chat request with ``headers`` to a route of class ``default``."""
    return traffic_class(request(**headers), default, caller(s, **headers))


# -- read_json ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_read_json_gives_the_object() -> None:
    body = {"model": "m", "messages": []}
    raw = json.dumps(body).encode()
    assert await read_json(request(raw, content_type="application/json; charset=utf-8")) == body


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("raw", "message", "param"),
    [
        (b"{not json", "not valid JSON", None),
        (b"", "not valid JSON", None),
        (b"[1, 2]", "must be a JSON object", None),
        (b'"m"', "must be a JSON object", None),
        (b'{"a": NaN}', "`a`: NaN is not a JSON number", "a"),
        (b'{"a": [-Infinity]}', "`a.0`: -Infinity is not a JSON number", "a.0"),
        (b'{"a": 1e400}', "`a`: The number 1e400 is out of range", "a"),
        (b'{"a": "x\\ud800y"}', "lone surrogate", "a"),
        (b'{"x\\udfff": 1}', "lone surrogate", None),  # a key: its object is named
        (b'{"b": {"x\\udfff": 1}}', "lone surrogate", "b"),
        (b'{"a": "\xed\xa0\x80"}', "lone surrogate", "a"),  # json.loads passes these through
        (b'{"a": ' + b"[" * 101 + b"]" * 101 + b"}", "nested deeper", None),
        (b"[" * 5000 + b"]" * 5000, "nested deeper", None),
    ],
)
async def test_read_json_errors(raw: bytes, message: str, param: str | None) -> None:
    with pytest.raises(APIError) as caught:
        await read_json(request(raw, content_type="application/json"))
    err = caught.value.body()["error"]
    assert caught.value.status == 400
    assert message in err["message"]
    assert (err["type"], err["param"]) == ("invalid_request_error", param)


@pytest.mark.anyio
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
async def test_read_json_needs_a_json_content_type(content_type: str | None) -> None:
    headers = {} if content_type is None else {"content_type": content_type}
    with pytest.raises(APIError) as caught:
        await read_json(request(b'{"model": "m"}', **headers))
    assert caught.value.status == 415
    assert caught.value.body()["error"]["code"] == "unsupported_media_type"


@pytest.mark.anyio
async def test_nesting_just_under_the_limit_is_read() -> None:
    raw = b'{"a": ' + b"[" * 99 + b"]" * 99 + b"}"
    assert await read_json(request(raw, content_type="application/json"))


# -- API keys and class override ----------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "key"),
    [
        ("Bearer k1", "k1"),
        ("bearer   k1  ", "k1"),
        ("Basic k1", None),
        ("Bearer ", None),
        ("", None),
    ],
)
def test_api_key(header: str, key: str | None) -> None:
    assert bearer_token(request(authorization=header).headers.raw) == key


def test_api_keys_enforced_only_when_configured() -> None:
    assert caller(settings()) == Caller(None, True)
    keyed = settings(api_keys=("k1", "k2"))
    assert caller(keyed, **bearer("k2")).key is not None
    for headers in ({}, bearer("nope")):
        refused = checked(keyed, **headers)
        assert isinstance(refused, APIError)
        assert refused.status == 401
        assert refused.err_type == "authentication_error"


def test_class_is_the_routes_without_the_header() -> None:
    for allowed in (True, False, ("k1",)):
        assert classed(B, settings(class_override=allowed)) is B


@pytest.mark.parametrize("value", ["batch", " Batch ", "BATCH"])
def test_header_overrides_when_allowed(value: str) -> None:
    assert classed(I, settings(), **{CLASS_HEADER: value}) is B


def test_header_refused_when_override_is_off() -> None:
    with pytest.raises(APIError) as caught:
        classed(I, settings(class_override=False), **{CLASS_HEADER: "batch"})
    assert caught.value.status == 403
    assert caught.value.err_type == "permission_error"


def test_header_allowed_only_for_listed_keys() -> None:
    s = settings(class_override=("k1",))
    assert classed(I, s, **{CLASS_HEADER: "batch"}, **bearer("k1")) is B
    assert classed(B, s, **{CLASS_HEADER: "interactive"}, **bearer("k1")) is I
    for headers in ({}, bearer("k2")):
        with pytest.raises(APIError) as caught:
            classed(I, s, **{CLASS_HEADER: "batch"}, **headers)
        assert caught.value.status == 403


def test_unknown_class_is_a_bad_request() -> None:
    with pytest.raises(APIError) as caught:
        classed(I, settings(), **{CLASS_HEADER: "urgent"})
    assert caught.value.status == 400
    assert "interactive" in caught.value.message and "batch" in caught.value.message


# -- prompt text and affinity ---------------------------------------------------------


def test_prompt_text_of_messages_and_prompts() -> None:
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": parts},
        {"role": "assistant", "content": None},
    ]
    assert prompt_text({"messages": messages}) == "system Be brief.\nuser look \nassistant "
    assert prompt_text({"prompt": "Once upon"}) == "Once upon"
    assert prompt_text({"prompt": [1, 2, 3]}) == "[1, 2, 3]"


def chat(*contents: str, **extra: Any) -> dict[str, Any]:
    roles = ["system", "user", "assistant", "user"]
    messages = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=False)]
    return {"model": "m", "messages": messages, **extra}


def key(body: dict[str, Any]) -> str:
    return affinity_key(body, prompt_text(body))


def test_affinity_user_wins() -> None:
    assert key(chat("a", "b", user="alice")) == "user:alice"
    assert key(chat("x", user="alice")) == "user:alice"


def test_affinity_follows_the_leading_messages() -> None:
    first = key(chat("sys", "q1"))
    assert first.startswith("lead:")
    assert key(chat("sys", "q1", "a1", "q2")) == first  # the same conversation
    assert key(chat("sys", "other")) != first
    assert key(chat("sys", "q1", user="")) == first  # an empty user is no user
    # the start of each leading message's text: a long shared start is one prefix
    long = "s" * 5000
    assert key(chat(long, "q1")) == key(chat(long + "tail", "q1"))
    assert key(chat(long, "q1")) != key(chat(long, "q2"))
    assert key(chat("sys", "q1")) != key(chat("user", "q1"))


def test_affinity_of_prompts() -> None:
    assert key({"prompt": "a" * 2000}) == key({"prompt": "a" * 1024 + "b"})
    assert key({"prompt": "abc"}) != key({"prompt": "abd"})


# -- token estimates ------------------------------------------------------------------


def test_estimator_starts_at_a_quarter_token_per_char() -> None:
    est = TokenEstimator()
    assert est.estimate("m", "x" * 400) == 100
    assert est.estimate("m", "") == 1


def test_estimator_learns_each_models_ratio() -> None:
    est = TokenEstimator()
    for _ in range(60):
        est.learn("m", "x" * 100, 50)  # this tokenizer: half a token per char
    assert est.estimate("m", "x" * 400) == 200
    assert est.estimate("other", "x" * 400) == 100


def test_estimator_moves_a_fraction_per_lesson_and_ignores_nonsense() -> None:
    est = TokenEstimator(tokens_per_char=0.25, weight=0.2)
    est.learn("m", "x" * 100, 75)  # seen 0.75: 0.25 + 0.2 * 0.5 = 0.35
    assert est.estimate("m", "x" * 100) == 35
    est.learn("m", "", 10)
    est.learn("m", "x" * 100, 0)
    assert est.estimate("m", "x" * 100) == 35


# -- stream wishes and the upstream body ----------------------------------------------------


@pytest.mark.parametrize(
    ("body", "wish"),
    [
        ({}, StreamWish(False, False)),
        ({"stream": False, "stream_options": {"include_usage": True}}, StreamWish(False, False)),
        ({"stream": True}, StreamWish(True, False)),
        ({"stream": True, "stream_options": None}, StreamWish(True, False)),
        ({"stream": True, "stream_options": {"include_usage": False}}, StreamWish(True, False)),
        ({"stream": True, "stream_options": {"include_usage": True}}, StreamWish(True, True)),
    ],
)
def test_stream_wish(body: dict[str, Any], wish: StreamWish) -> None:
    assert stream_wish(body) == wish


def test_upstream_body_always_streams_with_usage() -> None:
    body = {"model": "m", "messages": [], "stream": False, "temperature": 0}
    out = upstream_body(body, None)
    assert out == {**body, "stream": True, "stream_options": {"include_usage": True}}
    assert "priority" not in out
    assert body["stream"] is False and "stream_options" not in body  # not mutated


def test_upstream_body_keeps_other_stream_options() -> None:
    options = {"include_usage": False, "continuous_usage_stats": True}
    body = {"model": "m", "stream": True, "stream_options": options}
    out = upstream_body(body, None)
    assert out["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert options["include_usage"] is False


@pytest.mark.parametrize("priority", [-10, 0])
def test_upstream_body_priority(priority: int) -> None:
    assert upstream_body({"model": "m", "priority": 5}, priority)["priority"] == priority


def test_upstream_body_drops_a_clients_priority_for_an_fcfs_engine() -> None:
    # vLLM rejects a non-zero priority unless it runs the priority policy.
    assert "priority" not in upstream_body({"model": "m", "priority": 5}, None)
