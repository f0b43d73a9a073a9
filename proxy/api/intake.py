"""The outermost layer of the proxy's own: every request comes in through
:class:`Intake`, which does three jobs, each in its own module:

- gives the request its id, and every response an ``X-Request-Id`` header
  (:mod:`proxy.api.request_ids`);
- keeps its body within the limits (:mod:`proxy.api.body_limits`): its size, the
  time between its bytes, the bodies in flight;
- answers what nobody answered (:mod:`proxy.api.last_resort`).

One layer, not three: the send wrapper that adds the id also tells the last resort
whether the response has started, so every streamed event passes through one wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.api.body_limits import BodyLimits, BodyRead
from proxy.api.last_resort import LastResort
from proxy.api.request_ids import IdSend, give_request_id


@dataclass
class Intake:
    """ASGI middleware, keeping each request's body within ``limits``."""

    app: ASGIApp
    limits: BodyLimits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        give_request_id(scope)
        id_send = IdSend(scope, send)
        body: BodyRead | None = None
        try:
            async with LastResort(scope, id_send):
                body = self.limits.open(scope)  # a declared length refused: 413 or 503
                await self.app(scope, body.receive(receive), id_send)
        finally:
            if body is not None:
                body.close()
