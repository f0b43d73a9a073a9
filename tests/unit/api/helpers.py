"""vLLM-shaped stream chunks, a fake engine behind ``httpx.MockTransport``, and the
proxy app run in-process in front of it."""

from __future__ import annotations

import json
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI

from proxy.config import EngineConfig, Settings
from proxy.server import ProxyState, create_app

Json = dict[str, Any]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
DONE = b"data: [DONE]\n\n"
MESSAGES = [{"role": "user", "content": "Say hello to the world, please."}]
USAGE = {"prompt_tokens": 12, "total_tokens": 15, "completion_tokens": 3}

# -- chunks as vLLM writes them (pydantic ``model_dump_json``: compact JSON) ---------------


def sse(data: Json) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def chat_chunk(*choices: Json, model: str = "m", **top: Any) -> Json:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 17, "model": model}
    return {**head, "choices": list(choices), **top}


def delta(index: int = 0, finish: str | None = None, logprobs: Any = None, **fields: Any) -> Json:
    return {"index": index, "delta": fields, "logprobs": logprobs, "finish_reason": finish}


def completion_chunk(*choices: Json, model: str = "m", **top: Any) -> Json:
    head = {"id": "cmpl-1", "object": "text_completion", "created": 17, "model": model}
    return {**head, "choices": list(choices), **top}


def text(text: str, index: int = 0, finish: str | None = None, logprobs: Any = None) -> Json:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish,
        "stop_reason": None,
    }


def chat_events(pieces: Iterable[str] = ("Hello", " world", "!"), model: str = "m") -> list[bytes]:
    """A chat stream as vLLM sends it with ``include_usage``: role, content, finish,
    usage, ``[DONE]``."""
    out = [sse(chat_chunk(delta(role="assistant", content=""), model=model))]
    out += [sse(chat_chunk(delta(content=p), model=model)) for p in pieces]
    out.append(sse(chat_chunk(delta(content="", finish="stop"), model=model)))
    out.append(sse(chat_chunk(model=model, usage=USAGE)))
    return [*out, DONE]


def completion_events(pieces: Iterable[str] = ("Hello", " world", "!")) -> list[bytes]:
    out = [sse(completion_chunk(text(p))) for p in pieces]
    out.append(sse(completion_chunk(text("", finish="length"))))
    out.append(sse(completion_chunk(usage=USAGE)))
    return [*out, DONE]


# -- the fake engine ------------------------------------------------------------------


METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1
"""


@dataclass
class Call:
    engine: str
    path: str
    body: Any


Generate = Callable[["Call"], httpx.Response | Awaitable[httpx.Response]]


def chunked(data: bytes, size: int) -> AsyncIterator[bytes]:
    """``data`` in pieces of ``size`` bytes, cut wherever that falls."""

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(data), size):
            yield data[i : i + size]

    return pieces()


def stream_response(events: Iterable[bytes], size: int = 7) -> httpx.Response:
    body = b"".join(events)
    return httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=chunked(body, size)
    )


def fake_token_ids(body: Any, count: int) -> list[int]:
    """``count`` token ids that are the same for the same prompt and differ from the
    first token for another (as a tokenizer's would, for the prefix index)."""
    seed = zlib.crc32(json.dumps(body, sort_keys=True).encode())
    return [(seed + 7919 * i) % 50_000 for i in range(count)]


class FakeEngines:
    """vLLM engines behind one MockTransport handler, told apart by host name
    (``http://NAME.engine.test:8000``).

    Each engine answers ``/v1/models`` (its ``models``), ``/health``, ``/metrics``,
    ``/tokenize`` (``token_count``) and streams the two completion routes with
    :meth:`generate`, which a test may replace. Every call is kept in ``calls``.
    """

    def __init__(self, **models: list[str]) -> None:
        self.models = models or {"a": ["m"]}
        self.calls: list[Call] = []
        self.token_count = 4321
        self.generate: Generate = self.default_generate

    def url(self, name: str) -> str:
        return f"http://{name}.engine.test:8000"

    def config(self, name: str, **fields: Any) -> EngineConfig:
        return EngineConfig(url=self.url(name), name=name, **fields)

    def settings(self, **fields: Any) -> Settings:
        engines = tuple(self.config(name) for name in self.models)
        return Settings.from_keys(engines=fields.pop("engines", engines), **fields)

    def seen(self, path: str, engine: str | None = None) -> list[Call]:
        return [c for c in self.calls if c.path == path and engine in (None, c.engine)]

    @staticmethod
    def default_generate(call: Call) -> httpx.Response:
        if call.path == CHAT:
            return stream_response(chat_events(model=call.body["model"]))
        return stream_response(completion_events())

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        engine = request.url.host.removesuffix(".engine.test")
        body = json.loads(request.content) if request.content else None
        call = Call(engine, request.url.path, body)
        self.calls.append(call)
        if call.path == "/v1/models":
            cards = [{"id": m, "object": "model"} for m in self.models[engine]]
            return httpx.Response(200, json={"object": "list", "data": cards})
        if call.path == "/health":
            return httpx.Response(200)
        if call.path == "/metrics":
            return httpx.Response(200, text=METRICS)
        if call.path == "/tokenize":
            count = self.token_count
            tokens = fake_token_ids(call.body, count)
            return httpx.Response(
                200, json={"count": count, "max_model_len": 99999, "tokens": tokens}
            )
        if call.path in (CHAT, COMPLETIONS):
            response = self.generate(call)
            return response if isinstance(response, httpx.Response) else await response
        return httpx.Response(404, json={"detail": "Not Found"})


@asynccontextmanager
async def running(
    settings: Settings, engines: FakeEngines
) -> AsyncIterator[tuple[httpx.AsyncClient, ProxyState]]:
    """The proxy in front of ``engines``, lifespan run, and a client talking to it."""
    app: FastAPI = create_app(settings, transport=httpx.MockTransport(engines))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            yield client, app.state.proxy
