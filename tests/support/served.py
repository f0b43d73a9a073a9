"""An ASGI app on a real loopback socket, and what a test holds of a running server.

:func:`serve_app` runs any ASGI app (the simulated engine, the proxy) under uvicorn
in a background thread on a free port and stops it on exit. :class:`Served` is a
server on a port with a client for it, an official ``openai`` client on demand and
readers of its ``/metrics``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import uvicorn

from loadtests.engine_io.metrics import LabelledSamples, labelled_samples
from loadtests.support.processes import LOOPBACK
from tests.support.metrics import metric_sum
from tests.support.polling import wait_for


@dataclass
class Served:
    """A server on a loopback port, with a client for it and its /metrics."""

    base_url: str
    port: int
    http: httpx.Client

    def openai(self, **options: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="x", max_retries=0, **options)

    def metrics(self) -> LabelledSamples:
        response = self.http.get("/metrics")
        response.raise_for_status()
        return labelled_samples(response.text)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples called ``name`` whose labels include ``labels``."""
        return metric_sum(self.metrics(), name, **labels)

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> float:
        """Poll until ``predicate()`` holds; returns the seconds it took."""
        return wait_for(predicate, timeout)


@contextmanager
def serve_app(
    app: Any, what: str = "the server", *, host: str = LOOPBACK, port: int = 0
) -> Iterator[tuple[str, int]]:
    """Serve the ASGI ``app`` on ``host`` (a loopback address) and ``port`` (0: a free
    one); yields its base URL and port."""
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are
    # TCP, and without it every keep-alive response waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start")
            time.sleep(0.01)
        yield f"http://{host}:{port}", port
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@contextmanager
def serving(
    app: Any, what: str = "the server", *, host: str = LOOPBACK, port: int = 0
) -> Iterator[tuple[str, int, httpx.Client]]:
    """:func:`serve_app`, with a client for it: yields base URL, port and client."""
    with (
        serve_app(app, what, host=host, port=port) as (base_url, port),
        httpx.Client(base_url=base_url, timeout=10) as http,
    ):
        yield base_url, port, http
