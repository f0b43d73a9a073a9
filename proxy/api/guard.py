"""The outermost layer of the proxy's own: every request passes through
:class:`Guard`, which

- refuses a body larger than ``max_body_bytes`` (or the limit ``path_limits``
  gives its path: the Files API's uploads) with 413 before it is read in
  full: at once when ``Content-Length`` says so, else as soon as the bytes
  received pass the limit (the handler reading the body gets
  :class:`BodyTooLarge`, an :class:`~proxy.openai.errors.APIError`);
- gives every request an id and every response an ``X-Request-Id`` header with
  it: the client's own ``X-Request-Id`` if it is sane (:func:`sane_request_id`),
  else a new one. Handlers read it with :func:`request_id` and may replace it
  with :func:`set_request_id` (the completion routes do when the client's id is
  already in use by a request in flight) before the response starts;
- turns any exception nobody handled into an OpenAI-shaped 500 that carries the
  request id, logged once with that id and never the body;
- treats a client that went away while its body was read (``ClientDisconnect``)
  as the client's business: logged at debug, not as a traceback;
- answers 408 (and closes the connection) when no body bytes arrive for
  ``body_timeout_s`` while the application waits for them (:class:`BodyTimeout`);
- counts the bytes of every body in flight against ``max_body_bytes_in_flight``
  (:mod:`proxy.api.inflight`) and refuses a body the budget cannot take with 503 and
  ``Retry-After`` (:class:`BodiesBusy`): before reading it when ``Content-Length``
  says so, else as its chunks arrive. Uploads under ``path_limits`` are not counted:
  their routes stream them to disk.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Mapping

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.api.inflight import BodyBudget, BodyTicket, MemoryReturn, glibc_malloc_trim
from proxy.openai.errors import APIError

logger = logging.getLogger(__name__)


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
    """The request's id, as :class:`Guard` chose it."""
    rid: str = scope.setdefault("state", {}).setdefault("request_id", new_request_id())
    return rid


def set_request_id(scope: Scope, value: str) -> None:
    """Replace the request's id (before its response starts)."""
    scope.setdefault("state", {})["request_id"] = value


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


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"The request body is larger than the limit of {limit} bytes.",
            code="request_too_large",
        )


class BodyTimeout(APIError):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            408,
            f"No bytes of the request body arrived for {timeout_s:g} s.",
            code="request_timeout",
            headers={"Connection": "close"},
        )


BUSY_RETRY_AFTER_S = 1


class BodiesBusy(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            503,
            f"The proxy holds as many request bodies as it may ({limit} bytes in flight, "
            f"max_body_bytes_in_flight); retry shortly.",
            err_type="service_unavailable",
            code=503,
            headers={"Retry-After": str(BUSY_RETRY_AFTER_S)},
        )


def declared_length(scope: Scope) -> int | None:
    """The request's ``Content-Length``, if it gives a readable one."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class Guard:
    """ASGI middleware; see the module docstring. ``body_timeout_s`` None: no body
    read timeout; ``max_body_bytes_in_flight`` None: bodies in flight not counted."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        path_limits: Mapping[str, int] | None = None,
        body_timeout_s: float | None = None,
        max_body_bytes_in_flight: int | None = None,
    ) -> None:
        self.app = app
        self.limit = max_body_bytes
        self.path_limits = dict(path_limits or {})
        self.body_timeout_s = body_timeout_s
        self.bodies = (
            None if max_body_bytes_in_flight is None else BodyBudget(max_body_bytes_in_flight)
        )
        self.memory = MemoryReturn(
            collect_after_bytes=max_body_bytes_in_flight or 8 * max_body_bytes,
            trim=glibc_malloc_trim(),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        set_request_id(scope, _client_request_id(scope) or new_request_id())
        id_send = IdSend(scope, send)
        limit = self.path_limits.get(scope["path"], self.limit)
        length = declared_length(scope)
        if length is not None and length > limit:
            await _send_error(id_send, BodyTooLarge(limit), {})
            return
        ticket = self._ticket(scope)
        if ticket is not None and length and not ticket.cover(length):
            await _send_error(id_send, BodiesBusy(ticket.budget.limit), {})
            return
        try:
            await self.app(scope, self._guarded(receive, limit, ticket), id_send)
        except ClientDisconnect:
            logger.debug("client left while sending %s %s", scope["method"], scope["path"])
        except (BodyTooLarge, BodyTimeout, BodiesBusy) as exc:  # no handler answered it
            if not id_send.started:
                await _send_error(id_send, exc, {})
        except Exception:
            await self._failed(scope, id_send, id_send.started)
        finally:
            if ticket is not None:
                held = ticket.reserved
                ticket.release()
                self.memory.body_freed(held)

    def _ticket(self, scope: Scope) -> BodyTicket | None:
        """The request's reservation in the budget, if its body is counted."""
        if self.bodies is None or scope["path"] in self.path_limits:
            return None
        return self.bodies.ticket()

    def _guarded(self, receive: Receive, limit: int, ticket: BodyTicket | None) -> Receive:
        """``receive``, raising :class:`BodyTooLarge` once the body passes ``limit``,
        :class:`BodiesBusy` once the budget cannot take it, and :class:`BodyTimeout`
        when the next piece of the body takes longer than ``body_timeout_s``."""
        seen = 0
        complete = False
        timeout_s = self.body_timeout_s

        async def guarded() -> Message:
            nonlocal seen, complete
            if complete or timeout_s is None:
                message = await receive()
            else:
                try:
                    async with asyncio.timeout(timeout_s):
                        message = await receive()
                except TimeoutError:
                    raise BodyTimeout(timeout_s) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if seen > limit:
                    raise BodyTooLarge(limit)
                if ticket is not None and not ticket.cover(seen):
                    raise BodiesBusy(ticket.budget.limit)
            return message

        return guarded

    async def _failed(self, scope: Scope, send: Send, started: bool) -> None:
        rid = request_id(scope)
        path = scope["path"].encode("ascii", "backslashreplace").decode()
        logger.exception("unexpected error on %s %s (%s)", scope["method"], path, rid)
        if started:
            return  # the response is under way; the server closes the connection
        error = APIError(
            500,
            f"The proxy failed on this request; its id is {rid}.",
            err_type="server_error",
            code=rid,
        )
        await _send_error(send, error, {"x-request-id": rid})


async def _send_error(send: Send, error: APIError, headers: dict[str, str]) -> None:
    response = error.response(headers)
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": response.raw_headers,
        }
    )
    await send({"type": "http.response.body", "body": response.body})
