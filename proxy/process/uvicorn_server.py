"""One proxy process: the app on uvicorn, with a graceful drain.

On SIGTERM (or SIGINT):

1. the admission closes: requests still queued in the proxy (batch work waiting
   for its turn) are answered 503 with ``Retry-After``, as is any new request
   on a connection still open;
2. the listening sockets close, so new connections are refused;
3. requests in flight get ``drain_timeout_s`` to finish; the rest are cancelled,
   which closes their upstream requests (the engines abort them), each logged
   with the reason;
4. the process exits with status 0.

Connections are served by :func:`proxy.process.slow_clients.http_protocol`: uvicorn's
httptools protocol with a header read timeout and a cap on connections held
incomplete (``header_timeout_s``, ``max_incomplete_connections``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import signal
import socket
import threading
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp

from proxy.api.box import Box
from proxy.config import Settings
from proxy.process.slow_clients import ClientLimits, http_protocol
from proxy.server import ProxyState, create_app

logger = logging.getLogger(__name__)


def begin_drain(state: ProxyState) -> None:
    """Step 1 of the drain (see the module docstring), logged."""
    queued = state.admission.close()
    logger.warning(
        "draining: %d queued requests answered 503; requests in flight have %g s to "
        "finish before they are aborted upstream",
        queued,
        state.settings.serving.drain_timeout_s,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn's server, calling ``on_drain`` when the shutdown begins, and not
    raising the caught signal again once it is done (so the exit status is 0)."""

    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_drain = on_drain

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.on_drain()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


STARTUP_FAILURE = 3  # uvicorn's own exit status when the app did not start
GC_THRESHOLDS = (50_000, 20, 20)
"""The garbage collector's thresholds while serving (Python's default: 700, 10, 10).

Every request in flight holds a few hundred objects (its coroutines, scopes, the
upstream response), so with a thousand in flight the default's young collections
promote them by the hundred thousand and full collections follow every few hundred
requests: 65-195 ms each over 100,000-280,000 objects, ~30 % of the CPU of 1,024
one-token requests. A young generation of 50,000 objects lets most of a request's
objects die young: 1,024 one-token requests at once, three rounds each, 957-1,138
requests per CPU second against 595-776 with the default, and no full collection;
a young collection then takes ~11 ms (docs/overhead.md)."""


def uvicorn_config(app: ASGIApp, settings: Settings, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's configuration for serving ``app`` under ``settings``: its address, the
    drain's timeout, and connections under the slow-client limits."""
    return uvicorn.Config(
        app,
        host=settings.serving.host,
        port=settings.serving.port,
        log_level=log_level,
        # no handlers of uvicorn's own: its access and error lines go through the
        # proxy's format (proxy.logs), one format in the log
        log_config=None,
        timeout_graceful_shutdown=math.ceil(settings.serving.drain_timeout_s),  # whole seconds
        http=http_protocol(client_limits(settings)),
        ws="none",  # no WebSocket routes: an upgrade is an ordinary request
    )


def client_limits(settings: Settings) -> ClientLimits:
    """The slow-client limits of the settings (:mod:`proxy.process.slow_clients`)."""
    return ClientLimits(
        header_timeout_s=settings.edge.header_timeout_s,
        max_incomplete=settings.edge.max_incomplete_connections,
    )


def run_uvicorn(
    settings: Settings,
    log_level: str = "info",
    sockets: list[socket.socket] | None = None,
    box: Box | None = None,
) -> int:
    """Build the app (:func:`~proxy.server.create_app`) and serve it on ``sockets``
    (default: bind ``settings.serving.host``:``settings.serving.port``) until SIGTERM
    or SIGINT, then drain; 0, or :data:`STARTUP_FAILURE` if the app never started.
    ``box``: this process is one of a box's workers."""
    app: FastAPI = create_app(settings, box=box)
    gc.set_threshold(*GC_THRESHOLDS)

    def on_drain() -> None:
        state: ProxyState | None = getattr(app.state, "proxy", None)
        if state is not None:
            begin_drain(state)

    server = DrainingServer(uvicorn_config(app, settings, log_level), on_drain)
    server.run(sockets=sockets)
    return 0 if server.started else STARTUP_FAILURE
