"""The last resort around the app: an error nobody answered still gets an answer.

- an :class:`~proxy.openai.errors.APIError` (a body refused by
  :mod:`proxy.api.body_limits` before any handler read it, say) gets its own
  OpenAI-shaped answer;
- any other exception an OpenAI-shaped 500 that carries the request id
  (:mod:`proxy.api.request_ids`), logged once with that id and never the body;
- a client that went away while its body was read (``ClientDisconnect``) is the
  client's business: logged at debug, not as a traceback.

Once the response has started no other status can be sent: the error is logged (an
unexpected one) and the server closes the connection.
"""

from __future__ import annotations

import logging
from types import TracebackType

from starlette.requests import ClientDisconnect
from starlette.types import Scope, Send

from proxy.api.request_ids import IdSend, request_id
from proxy.openai.errors import APIError

logger = logging.getLogger(__name__)


class LastResort:
    """``async with LastResort(scope, send):`` around the app's call; ``send`` tells
    whether the response has started."""

    def __init__(self, scope: Scope, send: IdSend) -> None:
        self.scope = scope
        self.send = send

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        """Whether the exception was answered here (it goes no further)."""
        scope = self.scope
        if isinstance(exc, ClientDisconnect):
            logger.debug("client left while sending %s %s", scope["method"], scope["path"])
            return True
        if isinstance(exc, APIError):
            if not self.send.started:
                await send_error(self.send, exc, {})
            return True
        if not isinstance(exc, Exception):
            return False  # none, or cancellation: it goes on
        rid = request_id(scope)
        path = scope["path"].encode("ascii", "backslashreplace").decode()
        logger.exception("unexpected error on %s %s (%s)", scope["method"], path, rid)
        if not self.send.started:
            error = APIError(
                500,
                f"The proxy failed on this request; its id is {rid}.",
                err_type="server_error",
                code=rid,
            )
            await send_error(self.send, error, {"x-request-id": rid})
        return True


async def send_error(send: Send, error: APIError, headers: dict[str, str]) -> None:
    """Send ``error``'s answer as the whole response."""
    response = error.response(headers)
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": response.raw_headers,
        }
    )
    await send({"type": "http.response.body", "body": response.body})
