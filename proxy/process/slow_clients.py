"""Slow clients: how long a connection may take to send a request's headers, and how
many connections may be held incomplete at once.

uvicorn arms no timer while a request's headers arrive (``timeout_keep_alive`` only
closes a connection that sent nothing since its last response), so a client that
trickles its headers byte by byte holds a socket, and a file descriptor, for as long
as it likes. :func:`http_protocol` gives the server a subclass of uvicorn's
``HttpToolsProtocol`` (the parser the proxy runs, with uvloop) that adds:

- a header read timeout: a connection whose request headers are not complete within
  ``header_timeout_s`` of its opening, or of its previous response's end on a kept-alive
  connection, is closed (as nginx's ``client_header_timeout`` and Envoy's
  ``request_headers_timeout`` do: no response, the request never began);
- a cap on connections held incomplete: a connection counts from its opening, or its
  previous response's end, until its request is received in full (headers and body).
  Beyond ``max_incomplete`` the oldest is closed, as nginx closes its oldest idle or
  waiting connections when it runs out (``ngx_drain_connections``). Closing the oldest,
  not refusing the newest: a client that holds the cap with slow connections would
  otherwise lock every other client out, while a real client's request arrives within
  milliseconds and is never the oldest for long.

The body read timeout lives in :mod:`~proxy.api.body_limits` (it answers 408 while
the application reads the body). Only the httptools protocol is covered; the proxy
always serves with it (:func:`proxy.process.uvicorn_server.uvicorn_config`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

logger = logging.getLogger(__name__)

EVICTION_WARNING_INTERVAL_S = 60.0
"""The cap's evictions are logged as a warning at most this often (each at debug)."""


@dataclass(frozen=True, kw_only=True)
class ClientLimits:
    """``header_timeout_s``: the longest a connection may take to send complete request
    headers; ``max_incomplete``: the most connections held incomplete at once."""

    header_timeout_s: float
    max_incomplete: int


class Closable(Protocol):
    def close_incomplete(self, why: str) -> None: ...


class IncompleteConnections:
    """The connections held incomplete, oldest first; :meth:`hold` closes the oldest
    beyond ``cap``. One per server, on its event loop."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.evicted = 0
        self._held: dict[Closable, None] = {}  # insertion order: the oldest first
        self._warned_at: float | None = None

    def hold(self, conn: Closable, now: float) -> None:
        """``conn`` is incomplete from now on (the newest); close the oldest beyond the cap."""
        self._held.pop(conn, None)
        self._held[conn] = None
        while len(self._held) > self.cap:
            oldest = next(iter(self._held))
            del self._held[oldest]
            self.evicted += 1
            oldest.close_incomplete("over max_incomplete_connections")
            self._warn(now)

    def release(self, conn: Closable) -> None:
        """``conn`` is complete (or closed)."""
        self._held.pop(conn, None)

    def _warn(self, now: float) -> None:
        if self._warned_at is not None and now - self._warned_at < EVICTION_WARNING_INTERVAL_S:
            return
        logger.warning(
            "%d connections held incomplete (max_incomplete_connections): closed the oldest "
            "(%d so far)",
            self.cap,
            self.evicted,
        )
        self._warned_at = now


class ReadTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the header read timeout and the cap on
    incomplete connections (see the module docstring). Made for one server by
    :func:`http_protocol`, which sets the two class attributes."""

    limits: ClassVar[ClientLimits]
    incomplete: ClassVar[IncompleteConnections]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self.incomplete.release(self)
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        self._cancel_deadline()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self.incomplete.release(self)
        super().on_message_complete()

    def on_response_complete(self) -> None:
        next_request_received = bool(self.pipeline)
        super().on_response_complete()
        if not next_request_received and not self.transport.is_closing():
            self._await_request()

    def close_incomplete(self, why: str) -> None:
        """Close this connection, which has not sent its request in full."""
        if self.transport.is_closing():
            return
        logger.debug("closing an incomplete connection from %s: %s", self.client, why)
        self.transport.close()

    def _await_request(self) -> None:
        """The connection waits for a request: the header deadline starts, and it is
        held incomplete."""
        self._cancel_deadline()
        self._header_deadline = self.loop.call_later(
            self.limits.header_timeout_s, self.close_incomplete, "header_timeout_s passed"
        )
        self.incomplete.hold(self, self.loop.time())

    def _cancel_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None


def http_protocol(limits: ClientLimits) -> type[ReadTimeoutProtocol]:
    """The protocol class for one server (``uvicorn.Config(http=...)``): connections
    under ``limits``, counted together."""

    class ServerProtocol(ReadTimeoutProtocol):
        pass

    ServerProtocol.limits = limits
    ServerProtocol.incomplete = IncompleteConnections(limits.max_incomplete)
    return ServerProtocol
