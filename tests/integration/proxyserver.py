"""The proxy on a real loopback socket, and simulated engines that can be killed.

:func:`run_proxy` serves :func:`proxy.api.app.create_app` with the helper that
serves the simulated engine (:func:`.simserver.serve_app`); :func:`spawn_sim` runs
``whoseturn sim`` as a child process, so that a test can kill an engine the hard
way (``SIGKILL``: its sockets close under the proxy mid-stream), and
:func:`spawn_proxy` runs ``whoseturn serve`` (for measurements that should not
share a process, and its interpreter lock, with the load generator).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from proxy.api.app import create_app
from proxy.config import Settings, settings_from_dict

from .simserver import MODEL, Served, serve_app

# Upstream connections must fail fast in tests, and the engines' health is
# checked often; each test overrides what it needs.
PROXY_DEFAULTS: dict[str, Any] = {"connect_timeout_s": 1.0, "scrape_interval_s": 0.1}


@dataclass
class ProxyServer(Served):
    settings: Settings


def engine(url: str, name: str, **options: Any) -> dict[str, Any]:
    """An ``engines`` entry that names the model, so discovery cannot miss it."""
    return {"url": url, "name": name, "models": [MODEL], **options}


@contextmanager
def run_proxy(engines: Sequence[dict[str, Any]], **options: Any) -> Iterator[ProxyServer]:
    """Serve the proxy in front of ``engines`` (see :func:`engine`) for the ``with`` body.

    ``options`` are top-level settings (``health_interval_s=0.1`` ...).
    """
    settings = settings_from_dict({**PROXY_DEFAULTS, **options, "engines": list(engines)})
    with (
        serve_app(create_app(settings), "the proxy") as (base_url, port),
        httpx.Client(base_url=base_url, timeout=10) as http,
    ):
        yield ProxyServer(base_url=base_url, port=port, http=http, settings=settings)


@dataclass
class Process(Served):
    """A ``whoseturn`` child process serving HTTP."""

    process: subprocess.Popen[bytes]

    def kill(self) -> None:
        """``SIGKILL``: no drain, no goodbye; every open connection drops at once."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(5)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def closed_port_url() -> str:
    """A loopback URL where nothing listens (connections are refused)."""
    return f"http://127.0.0.1:{free_port()}"


@contextmanager
def spawn_sim(*flags: str, time_scale: float = 20.0) -> Iterator[Process]:
    """Run ``whoseturn sim --profile cpu-tiny --served-model-name tiny FLAGS`` until
    the ``with`` body ends (or :meth:`Process.kill`)."""
    args = ["sim", "--profile", "cpu-tiny", "--served-model-name", MODEL]
    args += ["--time-scale", str(time_scale), *flags]
    with _spawn(args, "/health") as process:
        yield process


@contextmanager
def spawn_proxy(*engine_urls: str) -> Iterator[Process]:
    """Run ``whoseturn serve --engine URL ...`` until the ``with`` body ends; it is
    ready once ``/readyz`` answers 200 (an engine passed a health check)."""
    args = ["serve", *(f"--engine={url}" for url in engine_urls)]
    with _spawn(args, "/readyz") as process:
        yield process


@contextmanager
def _spawn(args: list[str], ready_path: str) -> Iterator[Process]:
    port = free_port()
    command = [sys.executable, "-m", "proxy", "--log-level", "warning", *args]
    command += ["--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base_url, timeout=10) as http:
            _wait_ready(http, process, ready_path)
            yield Process(base_url=base_url, port=port, http=http, process=process)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


def _wait_ready(http: httpx.Client, process: subprocess.Popen[bytes], path: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args} exited early ({process.returncode})")
        try:
            if http.get(path, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"{process.args}: {path} never answered 200")


def post_raw(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    """Send a request on a bare socket and return the socket, unread (close it to
    hang up)."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head + data)
    return sock


def data_lines(response: httpx.Response) -> Iterator[str]:
    """The ``data:`` payloads of an SSE response, as they arrive.

    Keep the iterator while the stream should stay open: one dropped half-read
    is closed by the garbage collector, and with it the response.
    """
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")
