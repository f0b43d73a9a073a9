"""The outermost layer of the proxy's own: every request passes through
:class:`Guard`, which

- refuses a body larger than ``max_body_bytes`` (or the limit ``path_limits``
  gives its path: the Files API's uploads) with 413 before it is read in
  full: at once when ``Content-Length`` says so, else as soon as the bytes
  received pass the limit (the handler reading the body gets
  :class:`BodyTooLarge`, an :class:`~proxy.api.errors.APIError`);
- turns any exception nobody handled into an OpenAI-shaped 500 that carries a
  request id (``X-Request-Id``), logged once with that id and never the body;
- treats a client that went away while its body was read (``ClientDisconnect``)
  as the client's business: logged at debug, not as a traceback.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.api.errors import APIError

logger = logging.getLogger(__name__)


class StartWatch:
    """An ASGI ``send`` that remembers whether the response has started (after which
    no other status can be sent, only the body cut short)."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"The request body is larger than the limit of {limit} bytes.",
            code="request_too_large",
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
    """ASGI middleware; see the module docstring."""

    def __init__(
        self, app: ASGIApp, *, max_body_bytes: int, path_limits: Mapping[str, int] | None = None
    ) -> None:
        self.app = app
        self.limit = max_body_bytes
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope["path"], self.limit)
        length = declared_length(scope)
        if length is not None and length > limit:
            await _send_error(send, BodyTooLarge(limit), {})
            return
        watch = StartWatch(send)
        try:
            await self.app(scope, self._limited(receive, limit), watch)
        except ClientDisconnect:
            logger.debug("client left while sending %s %s", scope["method"], scope["path"])
        except Exception:
            await self._failed(scope, send, watch.started)

    def _limited(self, receive: Receive, limit: int) -> Receive:
        """``receive``, raising :class:`BodyTooLarge` once the body passes ``limit``."""
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        return limited

    async def _failed(self, scope: Scope, send: Send, started: bool) -> None:
        request_id = f"req-{uuid.uuid4().hex}"
        path = scope["path"].encode("ascii", "backslashreplace").decode()
        logger.exception("unexpected error on %s %s (%s)", scope["method"], path, request_id)
        if started:
            return  # the response is under way; the server closes the connection
        error = APIError(
            500,
            f"The proxy failed on this request; its id is {request_id}.",
            err_type="server_error",
            code=request_id,
        )
        await _send_error(send, error, {"x-request-id": request_id})


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
