"""The OpenAI-compatible API as the tests ask it, of an engine or of the proxy:
streamed answers with usage, an engine's own token count, a JSON body's shape."""

from __future__ import annotations

from typing import Any

import openai
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessageParam

from tests.support import MODEL
from tests.support.served import Served


def token_count(server: Served, body: dict[str, Any]) -> int:
    """The engine's own count of a prompt (``POST /tokenize``, model ``tiny``)."""
    response = server.http.post("/tokenize", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return int(response.json()["count"])


def json_shape(value: Any) -> Any:
    """The keys of a JSON value, recursively (lists by their items' shapes)."""
    if isinstance(value, dict):
        return {k: json_shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_shape(v) for v in value]
    return type(value).__name__


def streamed_chat(
    client: openai.OpenAI, messages: list[ChatCompletionMessageParam], **limits: int
) -> list[ChatCompletionChunk]:
    """Every chunk of a chat completion streamed with ``include_usage``; ``limits`` is
    ``max_tokens=N`` or ``max_completion_tokens=N``."""
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        **limits,
    )
    return list(stream)


def streamed_completion(client: openai.OpenAI, prompt: str, max_tokens: int) -> list[Completion]:
    """Every chunk of a text completion streamed with ``include_usage``."""
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    return list(stream)


def whole_chat_through_proxy(
    server: Served,
    client: openai.OpenAI,
    messages: list[ChatCompletionMessageParam],
    *,
    max_tokens: int,
    engine: str,
) -> ChatCompletion:
    """A whole (non-streamed) chat answer through the proxy, checked as any must be:
    interactive class, served by ``engine`` after a queue wait, a chat completion of
    exactly ``max_tokens`` tokens ended by length, its prompt counted as the engine
    (``server``) counts it."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=max_tokens
    )
    reply = raw.parse()
    assert raw.headers["x-whoseturn-class"] == "interactive"
    assert raw.headers["x-whoseturn-engine"] == engine
    assert float(raw.headers["x-whoseturn-queue-ms"]) >= 0
    assert reply.object == "chat.completion"
    assert reply.model == MODEL
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == token_count(server, {"messages": messages})
    assert reply.usage.completion_tokens == max_tokens
    return reply
