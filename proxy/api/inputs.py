"""What the proxy reads from a client's request: model, class, prompt size, affinity."""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from proxy.api.errors import APIError, bad_request
from proxy.config import Settings
from proxy.scheduler import TrafficClass

CLASS_HEADER = "x-whoseturn-class"
Json = dict[str, Any]


async def read_json(request: Request) -> Json:
    """The body as a JSON object, or a 400 that says what is wrong with it."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a string.", param="model")
    return body


def api_key(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def check_api_key(request: Request, settings: Settings) -> None:
    if settings.api_keys and api_key(request) not in settings.api_keys:
        raise APIError(401, "Invalid or missing API key.", err_type="authentication_error")


def traffic_class(request: Request, default: TrafficClass, settings: Settings) -> TrafficClass:
    """The route's class, or the one ``X-Whoseturn-Class`` asks for where allowed."""
    wanted = request.headers.get(CLASS_HEADER)
    if wanted is None:
        return default
    try:
        cls = TrafficClass(wanted.strip().lower())
    except ValueError:
        names = [c.value for c in TrafficClass]
        raise bad_request(f"X-Whoseturn-Class must be one of {names}.") from None
    allowed = settings.class_override
    if allowed is True or (isinstance(allowed, tuple) and api_key(request) in allowed):
        return cls
    raise APIError(403, "This API key may not set X-Whoseturn-Class.", err_type="permission_error")


def prompt_text(body: Json) -> str:
    """The prompt's text as the engine will see it, near enough to estimate its size."""
    if "messages" in body:
        parts = []
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role', '') if isinstance(m, dict) else ''} {content or ''}")
        return "\n".join(parts)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def affinity_key(body: Json) -> str:
    """A conversation's key: its ``user``, else a hash of its leading messages or text."""
    user = body.get("user")
    if isinstance(user, str) and user:
        return f"user:{user}"
    if isinstance(body.get("messages"), list):
        lead = json.dumps(body["messages"][:2], sort_keys=True, default=str)
    else:
        lead = prompt_text(body)[:1024]
    return "lead:" + hashlib.sha1(lead.encode(), usedforsecurity=False).hexdigest()


class TokenEstimator:
    """Prompt tokens from text length, with each model's ratio learned from ``usage``."""

    def __init__(self, tokens_per_char: float = 0.25, weight: float = 0.2) -> None:
        self._ratio: defaultdict[str, float] = defaultdict(lambda: tokens_per_char)
        self._weight = weight

    def estimate(self, model: str, text: str) -> int:
        return max(1, round(len(text) * self._ratio[model]))

    def learn(self, model: str, text: str, tokens: int) -> None:
        if text and tokens > 0:
            seen = tokens / len(text)
            self._ratio[model] += self._weight * (seen - self._ratio[model])


@dataclass(frozen=True)
class StreamWish:
    """What the client asked for: a stream or one body, with usage or without."""

    stream: bool
    include_usage: bool


def stream_wish(body: Json) -> StreamWish:
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
    return StreamWish(stream, usage)


def upstream_body(body: Json, priority: int | None) -> Json:
    """The body sent to the engine: always streamed, always with usage. The proxy
    decides priorities: ``priority`` is set for an engine running the priority
    policy and removed otherwise (vLLM rejects a non-zero one under FCFS)."""
    given = body.get("stream_options")
    options: Json = given if isinstance(given, dict) else {}
    out = {**body, "stream": True, "stream_options": {**options, "include_usage": True}}
    out.pop("priority", None)
    if priority is not None:
        out["priority"] = priority
    return out
