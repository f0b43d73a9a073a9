"""The official ``openai`` client talks to the proxy as it would to vLLM."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.http import data_lines
from tests.support.openai_api import (
    json_shape,
    streamed_chat,
    streamed_completion,
    token_count,
    whole_chat_through_proxy,
)
from tests.support.processes import closed_port_url

from .proxyserver import ProxyServer, engine, run_proxy
from .simserver import MODEL, SimServer, run_server, sim_settings

pytestmark = pytest.mark.integration

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Whose turn is it, and why?"},
]
PROMPT = "The batch waits; the chat goes first."
# Per answer, what differs between two runs of the same request.
VOLATILE = {"id", "created"}


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[SimServer, ProxyServer]]:
    """One simulated engine and a proxy in front of it, for the whole module."""
    with (
        run_server(sim_settings()) as sim,
        run_proxy([engine(sim.base_url, "sim-0")]) as proxy,
    ):
        yield sim, proxy


@pytest.fixture
def sim(pair: tuple[SimServer, ProxyServer]) -> SimServer:
    return pair[0]


@pytest.fixture
def proxy(pair: tuple[SimServer, ProxyServer]) -> ProxyServer:
    return pair[1]


def without(body: dict[str, Any], keys: set[str]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in keys}


# -- answers ---------------------------------------------------------------------


def test_chat_whole(sim: SimServer, proxy: ProxyServer) -> None:
    with proxy.openai() as client:
        reply = whole_chat_through_proxy(sim, client, MESSAGES, max_tokens=6, engine="sim-0")
    assert reply.choices[0].message.content is not None
    assert len(reply.choices[0].message.content.split()) == 6


def test_chat_streamed_with_and_without_usage(sim: SimServer, proxy: ProxyServer) -> None:
    with proxy.openai() as client:
        with_usage = streamed_chat(client, MESSAGES, max_tokens=5)
        plain = list(
            client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=5, stream=True
            )
        )
        whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    *tokens, last = with_usage
    assert [c.choices[0].finish_reason for c in tokens][-1] == "length"
    assert last.choices == []
    assert last.usage is not None and last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens == token_count(sim, {"messages": MESSAGES})
    # The proxy asks the engine for usage always, and keeps it from clients that did not.
    assert all(c.choices and c.usage is None for c in plain)
    text = "".join(c.choices[0].delta.content or "" for c in plain)
    assert text == "".join(c.choices[0].delta.content or "" for c in tokens)
    assert text == whole.choices[0].message.content


def test_text_completion_whole_and_streamed(sim: SimServer, proxy: ProxyServer) -> None:
    with proxy.openai() as client:
        whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
        chunks = streamed_completion(client, PROMPT, 3)
    assert whole.object == "text_completion"
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == token_count(sim, {"prompt": PROMPT})
    assert whole.usage.completion_tokens == 3
    *tokens, last = chunks
    assert [c.choices[0].finish_reason for c in tokens] == [None, None, "length"]
    assert "".join(c.choices[0].text for c in tokens) == whole.choices[0].text
    assert last.usage is not None and last.usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/completions", {"prompt": PROMPT}),
    ],
)
def test_assembled_body_has_the_engines_shape(
    sim: SimServer, proxy: ProxyServer, path: str, body: dict[str, Any]
) -> None:
    request = {"model": MODEL, **body, "max_tokens": 4}
    direct = sim.http.post(path, json=request)
    proxied = proxy.http.post(path, json=request)
    assert direct.status_code == proxied.status_code == 200
    assert proxied.headers["content-type"] == direct.headers["content-type"]
    assert json_shape(proxied.json()) == json_shape(direct.json())
    # The sim answers the same request the same way: all but ids and times agree.
    assert without(proxied.json(), VOLATILE) == without(direct.json(), VOLATILE)


# -- classes ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_batch_route(proxy: ProxyServer, stream: bool) -> None:
    request = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": stream}
    with proxy.http.stream("POST", "/batch/v1/chat/completions", json=request) as response:
        assert response.status_code == 200
        assert response.headers["x-whoseturn-class"] == "batch"
        if stream:
            events = list(data_lines(response))
            assert events[-1] == "[DONE]"
            text = "".join(
                json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
            )
        else:
            response.read()
            text = response.json()["choices"][0]["message"]["content"]
    assert len(text.split()) == 3


def test_class_header_makes_a_v1_request_batch(proxy: ProxyServer) -> None:
    with proxy.openai() as client:
        raw = client.completions.with_raw_response.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=2,
            extra_headers={"X-Whoseturn-Class": "batch"},
        )
    assert raw.headers["x-whoseturn-class"] == "batch"
    assert raw.parse().usage is not None
    before = proxy.metric("whoseturn_requests_total", **{"class": "batch", "outcome": "ok"})
    assert before >= 1


# -- errors ----------------------------------------------------------------------


def test_malformed_json_is_a_400_with_an_error_object(proxy: ProxyServer) -> None:
    response = proxy.http.post(
        "/v1/chat/completions",
        content=b'{"model": "tiny", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "JSON" in error["message"]


def test_unknown_model_is_not_found(proxy: ProxyServer) -> None:
    with proxy.openai() as client, pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=1)
    assert caught.value.status_code == 404
    assert "no-such-model" in caught.value.message


def test_prompt_too_long_passes_the_engines_400_through(sim: SimServer, proxy: ProxyServer) -> None:
    prompt = " ".join(f"w{i}" for i in range(3000))  # 3,000 tokens, context 2,048
    direct = sim.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert direct.status_code == 400
    with proxy.openai() as client, pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=prompt)
    assert caught.value.status_code == 400
    assert caught.value.response.content == direct.content
    assert caught.value.response.headers["x-whoseturn-engine"] == "sim-0"


@pytest.mark.parametrize("ejected", [False, True], ids=["not-yet-ejected", "ejected"])
def test_engine_down_is_a_503(ejected: bool) -> None:
    """Connect refused on the only engine: 503 (``InternalServerError`` in the
    client), whether the request finds it out or the health checks already did."""
    checks = 1 if ejected else 100
    options = {"unhealthy_after": checks, "health_interval_s": 0.05}
    with run_proxy([engine(closed_port_url(), "gone")], **options) as proxy:
        if ejected:
            proxy.wait_for(lambda: proxy.metric("whoseturn_engine_up", engine="gone") == 0)
        with proxy.openai(timeout=5) as client, pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
        assert type(caught.value) is openai.InternalServerError
        assert caught.value.status_code == 503
        error = caught.value.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert proxy.http.get("/readyz").status_code == 503


def test_engine_down_streaming_is_a_503() -> None:
    with run_proxy([engine(closed_port_url(), "gone")], unhealthy_after=100) as proxy:
        request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "stream": True}
        response = proxy.http.post("/v1/completions", json=request)
        assert response.status_code == 503
        assert response.headers["content-type"] == "application/json"
        assert response.json()["error"]["code"] == "engine_unavailable"
