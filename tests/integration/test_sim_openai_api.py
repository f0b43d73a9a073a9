"""The simulated engine speaks vLLM's OpenAI API to the official ``openai`` client."""

from __future__ import annotations

import dataclasses
import json

import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.openai_api import streamed_chat, streamed_completion

from .simserver import MODEL, SimServer, run_server, sim_settings

pytestmark = pytest.mark.integration

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Whose turn is it, and why?"},
]


def tokenize_count(sim: SimServer, body: dict[str, object]) -> int:
    response = sim.http.post("/tokenize", json=body)
    assert response.status_code == 200
    data = response.json()
    assert data["max_model_len"] == 2048
    assert len(data["tokens"]) == data["count"]
    return int(data["count"])


def test_chat_completion_whole(sim: SimServer) -> None:
    with sim.openai() as client:
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6)
    assert reply.object == "chat.completion"
    assert reply.model == MODEL
    assert reply.id.startswith("chatcmpl-")
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert choice.message.content is not None and len(choice.message.content.split()) == 6
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 6
    assert reply.usage.prompt_tokens == tokenize_count(sim, {"model": MODEL, "messages": MESSAGES})
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 6


def test_chat_completion_streamed_with_usage(sim: SimServer) -> None:
    with sim.openai() as client:
        chunks = streamed_chat(client, MESSAGES, max_completion_tokens=5)
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1
    first, *tokens, last = chunks
    assert first.choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in tokens] == [None] * 4 + ["length"]
    text = "".join(c.choices[0].delta.content or "" for c in tokens)
    assert len(text.split()) == 5
    assert last.choices == []
    assert last.usage is not None and last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens == tokenize_count(sim, {"messages": MESSAGES})


def test_streamed_and_whole_answers_agree(sim: SimServer) -> None:
    with sim.openai() as client:
        whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert whole.choices[0].message.content == streamed


def test_text_completion_whole_and_streamed(sim: SimServer) -> None:
    prompt = "The batch waits; the chat goes first."
    with sim.openai() as client:
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3)
        chunks = streamed_completion(client, prompt, 3)
    assert whole.object == "text_completion"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == tokenize_count(sim, {"prompt": prompt})
    *tokens, last = chunks
    assert [c.choices[0].finish_reason for c in tokens] == [None, None, "length"]
    assert "".join(c.choices[0].text for c in tokens) == whole.choices[0].text
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens


def test_prompt_as_token_ids(sim: SimServer) -> None:
    with sim.openai() as client:
        reply = client.completions.create(model=MODEL, prompt=[101, 202, 303, 404], max_tokens=2)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == 4


def test_raw_event_stream_ends_with_done(sim: SimServer) -> None:
    body = {"prompt": "one two three", "max_tokens": 2, "stream": True}
    with sim.http.stream("POST", "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunk = json.loads(events[0].removeprefix("data: "))
    assert set(chunk) == {"id", "object", "created", "model", "choices"}
    assert set(chunk["choices"][0]) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}


def test_max_tokens_defaults_to_the_rest_of_the_context() -> None:
    with run_server(sim_settings(max_model_len=64, time_scale=50)) as sim:
        body = {"prompt": "a b c d", "max_tokens": None}
        reply = sim.http.post("/v1/completions", json=body).json()
    assert reply["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 60,
        "total_tokens": 64,
    }  # no prompt_tokens_details: vLLM reports them only when asked (below)


def test_prompt_tokens_details_report_the_prefix_cache_when_asked() -> None:
    settings = dataclasses.replace(sim_settings(time_scale=50), enable_prompt_tokens_details=True)
    body = {"prompt": " ".join(f"w{i}" for i in range(40)), "max_tokens": 1}
    with run_server(settings) as sim:
        first = sim.http.post("/v1/completions", json=body).json()["usage"]
        again = sim.http.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    block = settings.scheduler.block_size
    assert again["prompt_tokens_details"] == {"cached_tokens": 40 // block * block}


def test_request_id_header_names_the_answer(sim: SimServer) -> None:
    response = sim.http.post(
        "/v1/completions",
        json={"prompt": "hello", "max_tokens": 1},
        headers={"X-Request-Id": "abc-123"},
    )
    assert response.headers["x-request-id"] == "abc-123"
    assert response.json()["id"] == "cmpl-abc-123"


def test_priority_honoured_under_the_priority_policy() -> None:
    with run_server(sim_settings(scheduling_policy="priority")) as sim:
        body = {"prompt": "urgent", "max_tokens": 1, "priority": -5}
        assert sim.http.post("/v1/completions", json=body).status_code == 200


def test_models_health_and_metrics_routes(sim: SimServer) -> None:
    with sim.openai() as client:
        models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert sim.http.get("/v1/models").json()["data"][0]["max_model_len"] == 2048
    health = sim.http.get("/health")
    assert health.status_code == 200 and health.content == b""
    assert sim.http.get("/metrics").headers["content-type"].startswith("text/plain")
