"""Refusals come back as vLLM's error bodies and map to the ``openai`` client's classes."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from .simserver import MODEL, SimServer

pytestmark = pytest.mark.integration

LONG_PROMPT = " ".join(f"w{i}" for i in range(2100))


@pytest.mark.parametrize(
    ("kwargs", "param", "phrase"),
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "at least 1"),
        ({"prompt": "hi", "max_tokens": -3}, "max_tokens", "at least 1"),
        ({"prompt": "a b c", "max_tokens": 2046}, "max_tokens", "2049 tokens (3 in the messages"),
        ({"prompt": LONG_PROMPT, "max_tokens": 1}, "prompt", "maximum context length is 2048"),
        ({"prompt": "hi", "max_tokens": 1, "n": 2}, "n", "n must be 1"),
        ({"prompt": "", "max_tokens": 1}, "prompt", "cannot be empty"),
        ({"prompt": [1, 99999], "max_tokens": 1}, "prompt", "out of vocabulary"),
        ({"prompt": "hi", "extra_body": {"priority": 1}}, "priority", "Priority scheduling"),
    ],
)
def test_bad_completion_requests(
    shared_sim: SimServer, kwargs: dict[str, Any], param: str, phrase: str
) -> None:
    with shared_sim.openai() as client, pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, **kwargs)
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["type"] == "BadRequestError"
    assert body["code"] == 400
    assert body["param"] == param
    assert phrase in body["message"]


def test_chat_over_the_context_names_max_completion_tokens(shared_sim: SimServer) -> None:
    messages: Any = [{"role": "user", "content": "hello"}]
    with shared_sim.openai() as client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5000)
    assert caught.value.param == "max_completion_tokens"
    assert "This model's maximum context length is 2048 tokens." in caught.value.message


def test_unknown_model_is_not_found(shared_sim: SimServer) -> None:
    messages: Any = [{"role": "user", "content": "hello"}]
    with shared_sim.openai() as client, pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-nothing", messages=messages)
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["type"] == "NotFoundError"
    assert body["message"] == "The model `gpt-nothing` does not exist."


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b'{"messages": [', None),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"content": "no role"}]}', "messages.0.role"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}', "max_tokens"),
    ],
)
def test_malformed_or_invalid_body_is_a_bad_request(
    shared_sim: SimServer, content: bytes, param: str | None
) -> None:
    response = shared_sim.http.post(
        "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "BadRequestError"
    assert error["code"] == 400
    assert error["param"] == param


def test_tokenize_needs_exactly_one_input(shared_sim: SimServer) -> None:
    response = shared_sim.http.post("/tokenize", json={"prompt": "a", "messages": []})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "BadRequestError"


def test_refused_requests_leave_the_engine_empty(shared_sim: SimServer) -> None:
    shared_sim.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
    assert shared_sim.metric("vllm:num_requests_waiting") == 0
    assert shared_sim.metric("vllm:num_requests_running") == 0
