"""The whole proxy in-process: routes, relay, assembly, retries and errors, in front
of fake vLLM engines behind ``httpx.MockTransport``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

from proxy.api.sse import SSEReader
from proxy.server import ProxyState

from .helpers import (
    CHAT,
    COMPLETIONS,
    DONE,
    MESSAGES,
    USAGE,
    Call,
    FakeEngines,
    chat_chunk,
    chat_events,
    completion_events,
    delta,
    running,
    sse,
    stream_response,
)

pytestmark = pytest.mark.anyio

Json = dict[str, Any]


JSON_TYPE = {"content-type": "application/json"}


def chat_body(**extra: Any) -> Json:
    return {"model": "m", "messages": MESSAGES, **extra}


def assert_openai_error(response: httpx.Response, status: int) -> Json:
    assert response.status_code == status
    error: Json = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def assert_whoseturn_headers(response: httpx.Response, cls: str, engine: str) -> None:
    assert response.headers["x-whoseturn-class"] == cls
    assert response.headers["x-whoseturn-engine"] == engine
    assert float(response.headers["x-whoseturn-queue-ms"]) >= 0


# -- streaming relay ------------------------------------------------------------------


async def test_stream_relayed_byte_for_byte_with_usage() -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        body = chat_body(stream=True, stream_options={"include_usage": True})
        response = await client.post(CHAT, json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.content == b"".join(chat_events())
    assert_whoseturn_headers(response, "interactive", "a")


async def test_stream_without_include_usage_drops_only_the_usage_chunk() -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post(CHAT, json=chat_body(stream=True))
    expected = [e for e in chat_events() if b'"usage"' not in e]
    assert len(expected) == len(chat_events()) - 1
    assert response.content == b"".join(expected)


async def test_completions_stream_relayed() -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        body = {"model": "m", "prompt": "Once", "stream": True}
        response = await client.post(COMPLETIONS, json=body)
    assert response.content == b"".join(e for e in completion_events() if b'"usage"' not in e)


async def test_odd_bytes_relayed_unchanged() -> None:
    """Comments, CRLF framing and non-JSON data reach the client as the engine sent them."""
    events = [
        b": hello\r\n\r\n",
        sse(chat_chunk(delta(role="assistant", content=""))).replace(b"\n", b"\r\n"),
        b'data:{"id":"x","choices":[{"index":0,"delta":{"content":"A"}}]}\n\n',
        b"data: not json\n\n",
        sse(chat_chunk(usage=USAGE)),
        DONE,
    ]
    engines = FakeEngines()
    engines.generate = lambda call: stream_response(events, size=3)
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post(CHAT, json=chat_body(stream=True))
    assert response.content == b"".join(e for e in events if b"usage" not in e)


# -- non-streaming answers ------------------------------------------------------------


async def test_chat_body_assembled() -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post(CHAT, json=chat_body())
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert_whoseturn_headers(response, "interactive", "a")
    assert response.json() == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 17,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello world!", "tool_calls": []},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "usage": USAGE,
        "prompt_logprobs": None,
    }


async def test_completion_body_assembled() -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post(COMPLETIONS, json={"model": "m", "prompt": "Once"})
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "Hello world!"
    assert body["usage"] == USAGE


# -- what the engine is sent ----------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_always_streams_with_usage_and_no_priority_under_fcfs(
    stream: bool,
) -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        await client.post(CHAT, json=chat_body(stream=stream, temperature=0.5))
    (call,) = engines.seen(CHAT)
    assert call.body == {
        **chat_body(temperature=0.5),
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def test_priority_sent_only_to_a_priority_engine() -> None:
    engines = FakeEngines(a=["m"], b=["m2"])
    settings = engines.settings(
        engines=(
            engines.config("a", scheduling_policy="priority"),
            engines.config("b", scheduling_policy="fcfs"),
        )
    )
    async with running(settings, engines) as (client, _):
        await client.post(CHAT, json=chat_body())
        await client.post("/batch" + CHAT, json=chat_body())
        await client.post(CHAT, json=chat_body(model="m2"))
    interactive, batch = engines.seen(CHAT, "a")
    assert interactive.body["priority"] == -10
    assert batch.body["priority"] == 0
    (fcfs,) = engines.seen(CHAT, "b")
    assert "priority" not in fcfs.body


# -- engine errors and retries --------------------------------------------------------


async def test_engine_4xx_passes_through_unchanged() -> None:
    raw = b'{"object":"error","message":"max_tokens is too large","type":"BadRequestError",'
    raw += b'"param":null,"code":400}'
    engines = FakeEngines(a=["m"], b=["m"])
    engines.generate = lambda call: httpx.Response(
        400, content=raw, headers={"content-type": "application/json"}
    )
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post(CHAT, json=chat_body(max_tokens=10**6))
        metrics = (await client.get("/metrics")).text
    assert 'outcome="client_error"} 1.0' in metrics
    assert response.status_code == 400
    assert response.content == raw
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-whoseturn-class"] == "interactive"
    assert len(engines.seen(CHAT)) == 1  # a client error is not retried


def answer_500(call: Call) -> httpx.Response:
    return httpx.Response(500, json={"error": {"message": "oops", "code": 500}})


def refuse(call: Call) -> httpx.Response:
    raise httpx.ConnectError("[Errno 111] Connection refused")


@pytest.mark.parametrize("failure", [answer_500, refuse], ids=["5xx", "connect"])
@pytest.mark.parametrize("stream", [False, True])
async def test_failure_on_first_engine_retried_on_another(failure: Any, stream: bool) -> None:
    engines = FakeEngines(a=["m"], b=["m"])

    def generate(call: Call) -> httpx.Response:
        if len(engines.seen(CHAT)) == 1:
            return failure(call)  # type: ignore[no-any-return]
        return FakeEngines.default_generate(call)

    engines.generate = generate
    async with running(engines.settings(), engines) as (client, _):
        with anyio.fail_after(5):  # a requeued job once waited for ever
            response = await client.post(CHAT, json=chat_body(stream=stream))
    first, second = engines.seen(CHAT)
    assert first.engine != second.engine
    assert response.status_code == 200
    assert response.headers["x-whoseturn-engine"] == second.engine
    if stream:
        assert response.content == b"".join(e for e in chat_events() if b"usage" not in e)
    else:
        assert response.json()["choices"][0]["message"]["content"] == "Hello world!"


async def test_5xx_with_no_other_engine_passes_through() -> None:
    engines = FakeEngines()
    engines.generate = answer_500
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post(CHAT, json=chat_body())
    assert response.status_code == 500
    assert response.json() == {"error": {"message": "oops", "code": 500}}


async def test_connect_failure_with_no_other_engine_is_503() -> None:
    engines = FakeEngines()
    engines.generate = refuse
    async with running(engines.settings(), engines) as (client, state):
        response = await client.post(CHAT, json=chat_body())
        assert not state.monitor.up["a"]
    assert_openai_error(response, 503)


def connect_timeout(call: Call) -> httpx.Response:
    raise httpx.ConnectTimeout("timed out")


async def test_a_connect_timeout_on_an_engine_that_answered_lately_connects_again() -> None:
    """Under a burst of new streams the proxy's own loop can miss a connect timeout
    on a healthy engine: the request (never sent) is connected again on the same
    engine, and the engine stays in rotation."""
    engines = FakeEngines()

    def generate(call: Call) -> httpx.Response:
        if len(engines.seen(CHAT)) == 1:
            return connect_timeout(call)
        return FakeEngines.default_generate(call)

    engines.generate = generate
    async with running(engines.settings(), engines) as (client, state):
        state.monitor.answered("a")  # as its passing health check records
        response = await client.post(CHAT, json=chat_body())
        assert state.monitor.up["a"]
    assert response.status_code == 200
    assert len(engines.seen(CHAT)) == 2


async def test_a_connect_timeout_on_an_engine_not_heard_from_ejects_it() -> None:
    engines = FakeEngines()
    engines.generate = connect_timeout
    async with running(engines.settings(), engines) as (client, state):
        state.monitor.answered_at.clear()
        response = await client.post(CHAT, json=chat_body())
        assert not state.monitor.up["a"]
    assert_openai_error(response, 503)
    assert len(engines.seen(CHAT)) == 1


ENGINE_ERROR = {"message": "out of memory", "type": "InternalServerError", "param": None}


MIDSTREAM = [*chat_events()[:2], sse({"error": {**ENGINE_ERROR, "code": 500}}), DONE]


def error_midstream(call: Call) -> httpx.Response:
    return stream_response(MIDSTREAM)


async def test_sse_error_midstream_relayed_to_a_stream() -> None:
    engines = FakeEngines()
    engines.generate = error_midstream
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post(CHAT, json=chat_body(stream=True))
        metrics = (await client.get("/metrics")).text
    assert response.status_code == 200
    assert response.content == b"".join(MIDSTREAM)
    line = 'whoseturn_requests_total{class="interactive",engine="a",outcome="engine_error"} 1.0'
    assert line in metrics


async def test_sse_error_midstream_becomes_an_error_answer() -> None:
    engines = FakeEngines()
    engines.generate = error_midstream
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post(CHAT, json=chat_body())
    assert assert_openai_error(response, 500) == {**ENGINE_ERROR, "code": 500}
    assert response.headers["x-whoseturn-engine"] == "a"


async def test_stream_broken_midway_ends_with_an_error_event() -> None:
    events = chat_events()[:3]

    async def broken() -> AsyncIterator[bytes]:
        for event in events:
            yield event
        raise httpx.ReadError("connection reset")

    engines = FakeEngines()
    engines.generate = lambda call: httpx.Response(200, content=broken())
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post(CHAT, json=chat_body(stream=True))
    assert response.content.startswith(b"".join(events))
    tail = SSEReader().feed(response.content[len(b"".join(events)) :])
    assert tail[0].error is not None and tail[0].error["type"] == "engine_error"
    assert tail[-1].done


async def test_answer_broken_midway_is_retried_whole_elsewhere() -> None:
    async def broken() -> AsyncIterator[bytes]:
        for event in chat_events()[:3]:
            yield event
        raise httpx.ReadError("connection reset")

    engines = FakeEngines(a=["m"], b=["m"])

    def generate(call: Call) -> httpx.Response:
        if len(engines.seen(CHAT)) == 1:
            return httpx.Response(200, content=broken())
        return FakeEngines.default_generate(call)

    engines.generate = generate
    async with running(engines.settings(), engines) as (client, _):
        with anyio.fail_after(5):
            response = await client.post(CHAT, json=chat_body())
    first, second = engines.seen(CHAT)
    assert first.engine != second.engine
    assert response.headers["x-whoseturn-engine"] == second.engine
    assert response.json()["choices"][0]["message"]["content"] == "Hello world!"


# -- the proxy's own errors -----------------------------------------------------------


async def test_unknown_model_is_404() -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post(CHAT, json=chat_body(model="gpt-9"))
    error = assert_openai_error(response, 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert engines.seen(CHAT) == []


@pytest.mark.parametrize("raw", [b"{oops", b"[]", b'{"messages": []}'])
async def test_malformed_body_is_400(raw: bytes) -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post(CHAT, content=raw, headers=JSON_TYPE)
    assert assert_openai_error(response, 400)["type"] == "invalid_request_error"


async def test_class_header_refused_when_override_is_off() -> None:
    engines = FakeEngines()
    async with running(engines.settings(class_override=False), engines) as (client, _):
        headers = {"X-Whoseturn-Class": "batch"}
        refused = await client.post(CHAT, json=chat_body(), headers=headers)
        plain = await client.post(CHAT, json=chat_body())
    assert assert_openai_error(refused, 403)["type"] == "permission_error"
    assert plain.status_code == 200


async def test_class_header_allowed_for_a_listed_key() -> None:
    engines = FakeEngines()
    settings = engines.settings(class_override=("k1",))
    async with running(settings, engines) as (client, _):
        allowed = await client.post(
            CHAT,
            json=chat_body(),
            headers={"X-Whoseturn-Class": "batch", "Authorization": "Bearer k1"},
        )
        refused = await client.post(
            CHAT,
            json=chat_body(),
            headers={"X-Whoseturn-Class": "batch", "Authorization": "Bearer k2"},
        )
    assert allowed.status_code == 200
    assert_whoseturn_headers(allowed, "batch", "a")
    assert_openai_error(refused, 403)


async def test_api_keys_enforced() -> None:
    engines = FakeEngines()
    async with running(engines.settings(api_keys=("k1",)), engines) as (client, _):
        missing = await client.post(CHAT, json=chat_body())
        wrong = await client.post(CHAT, json=chat_body(), headers={"Authorization": "Bearer x"})
        right = await client.post(CHAT, json=chat_body(), headers={"Authorization": "Bearer k1"})
    for response in (missing, wrong):
        assert assert_openai_error(response, 401)["type"] == "authentication_error"
    assert right.status_code == 200
    assert len(engines.seen(CHAT)) == 1


# -- prompt sizes ---------------------------------------------------------------------


def prompt_tokens_at_each_call(engines: FakeEngines, state: ProxyState) -> list[int]:
    """A list that fills, at each generation call to ``engines``, with the prompt
    tokens of the jobs the scheduler holds then."""
    seen: list[int] = []

    def generate(call: Call) -> httpx.Response:
        seen.extend(j.prompt_tokens for j in state.scheduler.jobs.values())
        return FakeEngines.default_generate(call)

    engines.generate = generate
    return seen


async def test_batch_request_counted_by_the_engines_tokenizer() -> None:
    engines = FakeEngines()
    engines.token_count = 5000
    async with running(engines.settings(), engines) as (client, state):
        seen = prompt_tokens_at_each_call(engines, state)
        response = await client.post("/batch" + CHAT, json=chat_body())
        inflight_after = dict(state.scheduler.jobs)
    assert response.status_code == 200
    assert_whoseturn_headers(response, "batch", "a")
    (tokenize,) = engines.seen("/tokenize")
    assert tokenize.body == {"model": "m", "messages": MESSAGES}
    assert seen == [5000]
    assert inflight_after == {}
    admitted = [d for d in state.scheduler.log if d.admitted]
    assert [(d.cls.value, d.engine) for d in admitted] == [("batch", "a")]


async def test_batch_completion_counted_by_prompt() -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        await client.post("/batch" + COMPLETIONS, json={"model": "m", "prompt": "Once"})
    (tokenize,) = engines.seen("/tokenize")
    assert tokenize.body == {"model": "m", "prompt": "Once"}


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [(["Once", "upon"], 2 * 4321), ([[1, 2, 3], [4, 5]], 5), ([7, 8, 9], 3)],
)
async def test_batch_prompt_lists_counted_as_their_sum(prompt: Any, tokens: int) -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, state):
        seen = prompt_tokens_at_each_call(engines, state)
        await client.post("/batch" + COMPLETIONS, json={"model": "m", "prompt": prompt})
    assert seen == [tokens]


async def test_batch_request_estimated_when_tokenize_fails() -> None:
    engines = FakeEngines()
    engines.token_count = -1  # not a count: the client reports a bad response
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post("/batch" + CHAT, json=chat_body())
    assert response.status_code == 200


async def test_interactive_request_estimated_then_learned_from_usage() -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, state):
        before = state.counter.estimator.estimate("m", "x" * 1000)
        await client.post(CHAT, json=chat_body())
        after = state.counter.estimator.estimate("m", "x" * 1000)
    assert engines.seen("/tokenize") == []
    assert after != before


# -- models and metrics ---------------------------------------------------------------


async def test_models_are_the_union_of_the_engines() -> None:
    engines = FakeEngines(a=["m", "shared"], b=["shared", "z-model"])
    async with running(engines.settings(), engines) as (client, _):
        response = await client.get("/v1/models")
        routed = await client.post(CHAT, json=chat_body(model="z-model"))
    body = response.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["m", "shared", "z-model"]
    assert all(m["object"] == "model" for m in body["data"])
    assert routed.headers["x-whoseturn-engine"] == "b"


async def test_metrics_after_a_request() -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        await client.post(CHAT, json=chat_body(stream=True))
        response = await client.get("/metrics")
    text = response.text
    assert response.headers["content-type"].startswith("text/plain")
    assert 'whoseturn_turn{engine="a",turn="idle"} 1.0' in text
    assert 'whoseturn_turn{engine="a",turn="batch"} 0.0' in text
    assert 'whoseturn_requests_total{class="interactive",engine="a",outcome="ok"} 1.0' in text
    assert 'whoseturn_ttft_seconds_count{class="interactive",engine="a"} 1.0' in text
    assert 'whoseturn_ttft_seconds_bucket{class="interactive",engine="a",le="+Inf"} 1.0' in text
    assert 'whoseturn_prompt_tokens_total{class="interactive",engine="a"} 12.0' in text
    assert 'whoseturn_completion_tokens_total{class="interactive",engine="a"} 3.0' in text
    assert 'whoseturn_engine_up{engine="a"} 1.0' in text
    assert "vllm:" not in text


async def test_health_and_readiness() -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        ready = await client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"ready": True, "engines_up": ["a"], "batch_store": None}
