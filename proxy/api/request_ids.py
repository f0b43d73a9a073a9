"""Every request's id: the client's own ``X-Request-Id`` if it is sane
(:func:`sane_request_id`), else a new one; every response carries it in an
``X-Request-Id`` header (:class:`IdSend`). :class:`~proxy.api.intake.Intake` gives the
id as a request comes in. Handlers read it with :func:`request_id` and may replace
it with :func:`set_request_id` (the completion routes do when the client's id is
already in use by a request in flight) before the response starts.
"""

from __future__ import annotations

import re
import uuid

from starlette.types import Message, Scope, Send

REQUEST_ID_HEADER = b"x-request-id"
_SANE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+=-]{0,127}")


def new_request_id() -> str:
    return f"wt-{uuid.uuid4().hex}"


def sane_request_id(value: str | None) -> str | None:
    """``value`` if it can serve as a request id (1-128 printable ASCII characters
    from a safe set, starting with a letter or digit), else None."""
    if value is None or not _SANE_ID.fullmatch(value):
        return None
    return value


def request_id(scope: Scope) -> str:
    """The request's id, as it was given when the request came in."""
    rid: str = scope.setdefault("state", {}).setdefault("request_id", new_request_id())
    return rid


def set_request_id(scope: Scope, value: str) -> None:
    """Replace the request's id (before its response starts)."""
    scope.setdefault("state", {})["request_id"] = value


def give_request_id(scope: Scope) -> None:
    """The request's id as it comes in: the client's own if sane, else a new one."""
    set_request_id(scope, _client_request_id(scope) or new_request_id())


def _client_request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER:
            return sane_request_id(value.decode("latin-1"))
    return None


class IdSend:
    """An ASGI ``send`` that adds ``X-Request-Id`` (the request's id as it stands
    when the response starts) unless the response names one itself, and remembers
    whether the response has started (after which no other status can be sent,
    only the body cut short). One wrapper, not two: every streamed event passes
    through it."""

    def __init__(self, scope: Scope, send: Send) -> None:
        self.scope = scope
        self.send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        if not self.started and message["type"] == "http.response.start":
            self.started = True
            headers = list(message.get("headers", ()))
            if all(name.lower() != REQUEST_ID_HEADER for name, _ in headers):
                headers.append((REQUEST_ID_HEADER, request_id(self.scope).encode("latin-1")))
                message = {**message, "headers": headers}
        await self.send(message)


def body_send(send: Send) -> Send:
    """Where a response whose head went out may send its body: past ``send``'s
    :class:`IdSend`, which has nothing more to add (a streamed response sends every
    event through this one call fewer)."""
    if isinstance(send, IdSend) and send.started:
        return send.send
    return send
