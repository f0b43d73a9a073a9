"""What a chat or completion request is, once read: the immutable
:class:`ChatRequest` (class, model, prompt, stream wish, affinity, the body for the
engine) that the HTTP edge (:func:`proxy.api.inputs.read_request`) and the batch
runner (:func:`proxy.batch.lines.line_request`) both make with :func:`describe`, and
the rest of the request path works from. It is for a tenant
(:class:`~proxy.config.Tenant`), whose tier moves its ``priority`` in an engine
running vLLM's priority policy (:func:`~proxy.scheduler.engine_priority`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from proxy.config import ANONYMOUS, Tenant
from proxy.scheduler import Tier, TrafficClass, engine_priority

Json = dict[str, Any]


def prompt_text(body: Json, chat: bool | None = None) -> str:
    """The prompt's text as the engine will see it, near enough to estimate its size:
    the ``messages`` of a chat request (``chat``; by default, a body that has them),
    else the ``prompt``."""
    if chat if chat is not None else "messages" in body:
        messages = body.get("messages")
        parts = []
        for m in messages if isinstance(messages, list) else []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role', '') if isinstance(m, dict) else ''} {content or ''}")
        return "\n".join(parts)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


LEAD_CHARS = 1024
"""How much of a prompt, or of each leading message's text, the affinity key hashes."""


def affinity_key(body: Json, text: str) -> str:
    """A conversation's key: its ``user``, else a hash of its two leading messages
    (the start of each one's text) or of the start of its prompt ``text``.

    Only the start of each text: conversations that share their first
    :data:`LEAD_CHARS` characters share the engine's cached prefix too, and
    serialising and hashing a whole 100,000-character message was ~0.4 ms of a
    request (docs/overhead.md)."""
    user = body.get("user")
    if isinstance(user, str) and user:
        return f"user:{user}"
    messages = body.get("messages")
    if isinstance(messages, list):
        lead = json.dumps([_lead(m) for m in messages[:2]], sort_keys=True, default=str)
    else:
        lead = text[:LEAD_CHARS]
    return "lead:" + hashlib.sha1(lead.encode(), usedforsecurity=False).hexdigest()


def _lead(message: Any) -> Any:
    if not isinstance(message, dict):
        return message
    return {k: v[:LEAD_CHARS] if isinstance(v, str) else v for k, v in message.items()}


@dataclass(frozen=True)
class StreamWish:
    """What the client asked for: a stream or one body, with usage or without."""

    stream: bool
    include_usage: bool


def stream_wish(body: Json) -> StreamWish:
    stream = body.get("stream") is True
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


@dataclass(frozen=True)
class ChatRequest:
    """One client request as the proxy understands it.

    ``messages`` (chat) or ``prompt`` (completions) are what a tokenizer counts;
    ``text`` is the prompt's text for an estimate; ``upstream`` is the body every
    engine is sent (streamed, with usage, no client ``priority``). ``tenant``: whom
    it is for (anonymous by default); ``flow``: what it shares its tenant's part
    with (a batch job's id for its lines; "" for a chat).
    """

    path: str
    cls: TrafficClass
    model: str
    messages: list[Any] | None
    prompt: Any
    text: str
    wish: StreamWish
    affinity: str
    upstream: Json
    tenant: Tenant = ANONYMOUS
    flow: str = ""

    @property
    def chat(self) -> bool:
        return self.path.endswith("/chat/completions")

    @property
    def tier(self) -> Tier:
        """Its tenant's tier."""
        return Tier(self.tenant.tier)

    @property
    def engine_priority(self) -> int:
        """Its ``priority`` in an engine under vLLM's priority policy: its class's,
        moved by its tenant's tier."""
        return engine_priority(self.cls, self.tier)

    @property
    def expected_output(self) -> int:
        """The output tokens it may generate, where the body caps them
        (``max_completion_tokens``, else ``max_tokens``); 0: not said."""
        for name in ("max_completion_tokens", "max_tokens"):
            value = self.upstream.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return 0

    def body_for(self, scheduling_policy: str) -> Json:
        """The body for an engine running ``scheduling_policy``: the priority of its
        class and tier under ``priority``, none under FCFS."""
        if scheduling_policy != "priority":
            return self.upstream
        return upstream_body(self.upstream, self.engine_priority)


def describe(
    body: Json,
    path: str,
    cls: TrafficClass,
    sent: Json | None = None,
    *,
    tenant: Tenant = ANONYMOUS,
    flow: str = "",
) -> ChatRequest:
    """The description of a checked completion ``body`` for ``path``, for ``tenant``
    (and ``flow``, a batch job's id for its lines); ``sent`` is the body as it goes
    upstream (and says the stream wish) where it differs."""
    chat = path.endswith("/chat/completions")
    messages = body.get("messages") if chat else None
    text = prompt_text(body, chat)
    sent = body if sent is None else sent
    return ChatRequest(
        path=path,
        cls=cls,
        model=body["model"],
        messages=messages if isinstance(messages, list) else None,
        prompt=body.get("prompt"),
        text=text,
        wish=stream_wish(sent),
        affinity=affinity_key(body, text),
        upstream=upstream_body(sent, None),
        tenant=tenant,
        flow=flow,
    )
