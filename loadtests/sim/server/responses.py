"""Response bodies and server-sent-event chunks, shaped as vLLM's.

A :class:`Renderer` knows one endpoint's shapes: the whole body of a non-streaming
answer, the chunks of a streamed one (chat sends the assistant's role in a chunk
of its own before the first token, as vLLM does; the chunk of the last token
carries ``finish_reason``), and the closing usage chunk (``choices: []``) that
``stream_options.include_usage`` asks for.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

Json = dict[str, Any]

DONE = "data: [DONE]\n\n"


def sse(data: Json) -> str:
    """One server-sent event carrying ``data`` as compact JSON."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> Json:
    """OpenAI's ``usage``; with ``cached_tokens``, the prompt tokens found in the prefix
    cache as ``prompt_tokens_details`` (vLLM with ``--enable-prompt-tokens-details``)."""
    out: Json = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def random_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True, kw_only=True)
class ResponseMeta:
    """What every body and chunk of one answer repeats."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, obj: str) -> Json:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


class Renderer(Protocol):
    @property
    def meta(self) -> ResponseMeta: ...

    def first_chunks(self) -> list[Json]: ...
    def token_chunk(self, text: str, finish_reason: str | None) -> Json: ...
    def usage_chunk(self, usage: Json) -> Json: ...
    def body(self, text: str, finish_reason: str | None, usage: Json) -> Json: ...


@dataclass(frozen=True)
class ChatRenderer:
    """``/v1/chat/completions``: ``chat.completion`` and ``chat.completion.chunk``."""

    meta: ResponseMeta

    def _chunk(self, delta: Json, finish_reason: str | None) -> Json:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**self.meta.head("chat.completion.chunk"), "choices": [choice]}

    def first_chunks(self) -> list[Json]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def token_chunk(self, text: str, finish_reason: str | None) -> Json:
        return self._chunk({"content": text}, finish_reason)

    def usage_chunk(self, usage: Json) -> Json:
        return {**self.meta.head("chat.completion.chunk"), "choices": [], "usage": usage}

    def body(self, text: str, finish_reason: str | None, usage: Json) -> Json:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        return {
            **self.meta.head("chat.completion"),
            "choices": [choice],
            "usage": usage,
            "prompt_logprobs": None,
        }


@dataclass(frozen=True)
class CompletionRenderer:
    """``/v1/completions``: ``text_completion`` bodies and chunks."""

    meta: ResponseMeta

    @staticmethod
    def _choice(text: str, finish_reason: str | None) -> Json:
        return {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }

    def first_chunks(self) -> list[Json]:
        return []

    def token_chunk(self, text: str, finish_reason: str | None) -> Json:
        return {**self.meta.head("text_completion"), "choices": [self._choice(text, finish_reason)]}

    def usage_chunk(self, usage: Json) -> Json:
        return {**self.meta.head("text_completion"), "choices": [], "usage": usage}

    def body(self, text: str, finish_reason: str | None, usage: Json) -> Json:
        choice = {**self._choice(text, finish_reason), "prompt_logprobs": None}
        return {**self.meta.head("text_completion"), "choices": [choice], "usage": usage}
