"""One error shape: a wrong model name is answered with the models served (on every
completion route and for a batch line), and an error's ``code`` is a string naming
the condition, or null, never the HTTP status, on every error path the proxy
answers itself."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

from proxy.api.body_limits import bodies_busy, too_large, too_slow
from proxy.api.sse import SSEReader, sse_error
from proxy.api.stream import CUT_OFF
from proxy.batch.lines import answered, line_request
from proxy.openai.errors import MODELS_LISTED, engine_failed, engine_unavailable, models_served

from .helpers import CHAT, COMPLETIONS, MESSAGES, Call, FakeEngines, chat_events, running

pytestmark = pytest.mark.anyio

Json = dict[str, Any]
ROUTES = [CHAT, COMPLETIONS, "/batch" + CHAT, "/batch" + COMPLETIONS]
JSON_TYPE = {"content-type": "application/json"}


def body_for(route: str, model: str = "m", **extra: Any) -> Json:
    if route.endswith(CHAT):
        return {"model": model, "messages": MESSAGES, **extra}
    return {"model": model, "prompt": "Say hello.", **extra}


def not_found(model: str, served: str) -> Json:
    """OpenAI's answer to a model it does not serve, with the models served."""
    return {
        "error": {
            "message": f"The model `{model}` does not exist. Models served: {served}.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


# -- a wrong model name ---------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
async def test_a_wrong_model_is_a_404_that_lists_the_models_served(route: str) -> None:
    engines = FakeEngines(a=["m"], b=["n", "m"])
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post(route, json=body_for(route, "gpt-9"))
    assert response.status_code == 404
    assert response.json() == not_found("gpt-9", "m, n")
    assert engines.seen(CHAT) == engines.seen(COMPLETIONS) == []


async def test_a_batch_line_for_a_wrong_model_names_the_models_served() -> None:
    """A line is answered by the same path as a request (what the batch runner
    calls), and its error-file line carries that answer."""
    engines = FakeEngines(a=["m"], b=["n"])
    asked = body_for(CHAT, "gpt-9")
    async with running(engines.settings(), engines) as (_, state):
        answer = await state.forwarder.complete(line_request(asked, CHAT), "batch_1-line-1")
    assert (answer.status, answer.body) == (404, not_found("gpt-9", "m, n"))
    result = answered("line-1", answer, asked)
    line = json.loads(result.line)
    assert not result.ok
    assert line["response"]["status_code"] == 404
    assert line["response"]["body"] == not_found("gpt-9", "m, n")


class Unreachable(FakeEngines):
    """Fake engines, of which those named in ``down`` refuse every connection."""

    def __init__(self, down: set[str], **models: list[str]) -> None:
        super().__init__(**models)
        self.down = down

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.host.removesuffix(".engine.test") in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        return await super().__call__(request)


async def test_a_model_unknown_while_an_engine_is_unreached_is_503_naming_those_served() -> None:
    engines = Unreachable({"a"}, a=["m"], b=["other"])
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post(CHAT, json=body_for(CHAT, "gpt-9"))
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "engine_unavailable"
    assert error["message"].endswith("Models served: other.")


def test_a_long_list_of_models_is_cut_and_counted() -> None:
    names = [f"model-{i:03d}" for i in range(MODELS_LISTED + 7)]
    sentence = models_served(names)
    assert sentence.startswith("Models served: model-000, model-001, ")
    assert f"model-{MODELS_LISTED - 1:03d} and 7 more (GET /v1/models lists them)." in sentence
    assert f"model-{MODELS_LISTED:03d}" not in sentence
    assert models_served([]) == "No engine serves any model."


# -- `code`: a string or null, never a number ----------------------------------------


def broken_after(count: int) -> httpx.Response:
    """An engine's stream that breaks after its first ``count`` events."""

    async def chunks() -> AsyncIterator[bytes]:
        for event in chat_events()[:count]:
            yield event
        raise httpx.ReadError("connection reset")

    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())


def refuse(call: Call) -> httpx.Response:
    raise httpx.ConnectError("[Errno 111] Connection refused")


def code_of(response: httpx.Response) -> Any:
    """The ``code`` of an OpenAI-shaped error answer (asserting the shape)."""
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error["code"]


def event_code(raw: bytes) -> Any:
    """The ``code`` of the SSE error event in a stream's bytes."""
    errors = [e.error for e in SSEReader().feed(raw) if e.error is not None]
    assert len(errors) == 1, raw
    assert set(errors[0]) == {"message", "type", "param", "code"}
    return errors[0]["code"]


async def failing(generate: Any, stream: bool = False) -> httpx.Response:
    """The answer of a proxy in front of one engine whose completions ``generate``
    answers (a fresh proxy: a failure may eject the engine)."""
    engines = FakeEngines()
    engines.generate = generate
    async with running(engines.settings(), engines) as (client, _):
        with anyio.fail_after(5):
            return await client.post(CHAT, json=body_for(CHAT, stream=stream))


async def test_every_error_the_edge_answers_has_a_string_or_null_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each error path reachable in-process, with the code it gives: names for the
    proxy's own conditions, null where OpenAI gives none."""
    codes: dict[str, Any] = {}
    engines = FakeEngines()
    async with running(engines.settings(max_body_bytes=4096), engines) as (client, _):
        codes["no route"] = code_of(await client.get("/no/such/route"))
        codes["wrong method"] = code_of(await client.get(CHAT))
        codes["bad query"] = code_of(await client.get("/turn/log", params={"limit": "lots"}))
        codes["not JSON"] = code_of(await client.post(CHAT, content=b"{oops", headers=JSON_TYPE))
        codes["media type"] = code_of(await client.post(CHAT, content=b"{}"))
        too_big = {**JSON_TYPE, "content-length": "5000"}
        codes["too large"] = code_of(await client.post(CHAT, content=b"x" * 5000, headers=too_big))
        codes["wrong model"] = code_of(await client.post(CHAT, json=body_for(CHAT, "gpt-9")))

    codes["broken answer"] = code_of(await failing(lambda call: broken_after(2)))
    streamed = await failing(lambda call: broken_after(2), stream=True)
    codes["broken stream"] = event_code(streamed.content)
    codes["engine down"] = code_of(await failing(refuse))

    engines = FakeEngines()
    async with running(engines.settings(api_keys=("sk-1",)), engines) as (client, _):
        codes["no key"] = code_of(await client.post(CHAT, json=body_for(CHAT)))

    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, state):

        async def broken(*_: Any) -> None:
            raise RuntimeError("something the proxy did not expect")

        with monkeypatch.context() as patch:
            patch.setattr(state.forwarder, "handle", broken)
            unexpected = await client.post(CHAT, json=body_for(CHAT))
        codes["unexpected"] = code_of(unexpected)
        state.admission.close()
        codes["draining"] = code_of(await client.post("/batch" + CHAT, json=body_for(CHAT)))

    assert codes.pop("unexpected") == unexpected.headers["x-request-id"]  # as documented
    assert codes == {
        "no route": "route_not_found",
        "wrong method": "method_not_allowed",
        "bad query": None,
        "not JSON": None,
        "media type": "unsupported_media_type",
        "too large": "request_too_large",
        "wrong model": "model_not_found",
        "broken answer": "engine_failed",
        "broken stream": "engine_failed",
        "engine down": "engine_unavailable",
        "no key": None,
        "draining": "shutting_down",
    }


def test_the_errors_made_outside_a_handler_have_string_codes() -> None:
    """The errors the body guard, the relay and the drain build before or after a
    handler runs: none carries the HTTP status as its code."""
    built = {
        "bodies busy": bodies_busy(1 << 20).body()["error"]["code"],
        "too large": too_large(4096).body()["error"]["code"],
        "too slow": too_slow(30).body()["error"]["code"],
        "engine failed": engine_failed("x").body()["error"]["code"],
        "engine unavailable": engine_unavailable("x", 1).body()["error"]["code"],
        "stream error": event_code(sse_error("x")),
        "stream cut off": event_code(CUT_OFF),
    }
    assert built == {
        "bodies busy": "server_busy",
        "too large": "request_too_large",
        "too slow": "request_timeout",
        "engine failed": "engine_failed",
        "engine unavailable": "engine_unavailable",
        "stream error": "engine_failed",
        "stream cut off": "shutting_down",
    }
