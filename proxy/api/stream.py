"""A streaming client's response: the engine's events relayed as they complete.

:class:`RelayResponse` is a raw ASGI response, not Starlette's ``StreamingResponse``.
Every token passes through here, and ``StreamingResponse`` pulls each event out of
an async generator (the relay's events, wrapped in one more) before it sends it;
this response sends each event from the relay's own loop
(:meth:`~proxy.api.relay.Relay.pump`), one ASGI message per upstream read (the
events that read completed; docs/overhead.md, "The relay made cheaper").

What it keeps from ``StreamingResponse``: the same status and headers
(``text/event-stream; charset=utf-8`` and the caller's), a task that waits for
``http.disconnect`` and cancels the relay at once (uvicorn, at ASGI spec 2.3, does
not fail a send to a client that has gone), and ``background`` run after a whole
response. What it adds: when the response ends for any reason (finished, client
gone, engine broken, the drain's timeout) the upstream is closed and the outcome
recorded exactly once.
"""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from proxy.api.disconnect import cancelled_on_disconnect
from proxy.api.relay import Relay
from proxy.api.request_ids import body_send
from proxy.api.sse import SSEEvent, sse_error
from proxy.engines import EngineMonitor, UpstreamError, map_stream_error

logger = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"
CUT_OFF_MESSAGE = "The proxy is shutting down; the stream was cut off."
CUT_OFF = sse_error(CUT_OFF_MESSAGE, "service_unavailable", "shutting_down") + DONE


class RelayResponse(Response):
    """The engine's events relayed as they complete (see the module docstring)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        relay: Relay,
        stack: AsyncExitStack,
        include_usage: bool,
        headers: dict[str, str],
        monitor: EngineMonitor,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(headers)
        self.relay = relay
        self.stack = stack
        self.include_usage = include_usage
        self.monitor = monitor
        self.outcome = "cancelled"
        self.started = False
        self._closed = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._respond(receive, send)
        except anyio.get_cancelled_exc_class():
            if not self.relay.services.admission.closed:
                raise
            # The drain timeout passed (the server cancels what is still running):
            # end the stream properly instead, once the upstream is closed.
            with anyio.CancelScope(shield=True):
                await self._close()
                if self.started:
                    await send({"type": "http.response.body", "body": CUT_OFF, "more_body": False})
        finally:
            with anyio.CancelScope(shield=True):
                await self._close()

    async def _respond(self, receive: Receive, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        self.started = True
        send = body_send(send)
        whole = False
        with cancelled_on_disconnect(receive):
            whole = await self._relay(send)
        if whole and self.background is not None:
            await self.background()

    async def _relay(self, send: Send) -> bool:
        """Relay the stream to its end; whether the response was sent whole (a
        client gone cancels this instead)."""
        include_usage = self.include_usage

        async def deliver(events: list[SSEEvent]) -> None:
            if len(events) == 1:
                event = events[0]
                if include_usage or not event.is_usage_only:
                    await send({"type": "http.response.body", "body": event.raw, "more_body": True})
                return
            body = b"".join(e.raw for e in events if include_usage or not e.is_usage_only)
            if body:
                await send({"type": "http.response.body", "body": body, "more_body": True})

        relay = self.relay
        end = b""
        try:
            await relay.pump(deliver)
            self.outcome = "engine_error" if relay.stats.engine_error else "ok"
            self.monitor.request_succeeded(relay.engine)
        except (httpx.HTTPError, UpstreamError) as exc:
            error = map_stream_error(relay.engine, exc)
            self.monitor.request_failed(relay.engine, error)
            self.outcome = "engine_error"
            logger.warning("stream %s broke on %s: %s", relay.ticket.id, relay.engine, error)
            end = sse_error(f"The engine failed mid-stream: {error}") + DONE
        await self._close()
        await send({"type": "http.response.body", "body": end, "more_body": False})
        return True

    async def _close(self) -> None:
        """Close the upstream and record the outcome, once."""
        if self._closed:
            return
        self._closed = True
        relay = self.relay
        if self.outcome == "cancelled" and relay.services.admission.closed:
            logger.warning(
                "stream %s aborted upstream on %s: the drain timeout passed",
                relay.ticket.id,
                relay.engine,
            )
        await close_shielded(self.stack)
        relay.finish(self.outcome)


async def close_shielded(stack: AsyncExitStack) -> None:
    """Close ``stack`` (an upstream response and its connection) even while the
    caller is being cancelled."""
    with anyio.CancelScope(shield=True):
        await stack.aclose()
