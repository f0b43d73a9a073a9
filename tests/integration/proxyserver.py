"""The proxy on a real loopback socket, and simulated engines that can be killed.

:func:`run_proxy` serves :func:`proxy.server.create_app` in a background thread
(:func:`tests.support.served.serve_app`); :func:`spawn_sim` runs
``whoseturn sim`` as a child process, so that a test can kill an engine the hard
way (``SIGKILL``: its sockets close under the proxy mid-stream), and
:func:`spawn_proxy` runs ``whoseturn serve`` (for measurements that should not
share a process, and its interpreter lock, with the load generator).
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from proxy.config import Settings, settings_from_dict
from proxy.engines import Resolver, resolve_addresses
from proxy.replicas import Ledger
from proxy.server import create_app
from tests.support import MODEL
from tests.support.processes import (
    free_port,
    loopback_url,
    running,
    sim_command,
    wait_until_ok,
    whoseturn_command,
)
from tests.support.served import Served, serving

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
def run_proxy(
    engines: Sequence[dict[str, Any]],
    *,
    resolver: Resolver = resolve_addresses,
    ledger: Ledger | None = None,
    **options: Any,
) -> Iterator[ProxyServer]:
    """Serve the proxy in front of ``engines`` (see :func:`engine`) for the ``with`` body.

    ``options`` are top-level settings (``health_interval_s=0.1`` ...); ``resolver``
    answers the DNS look-ups of ``dns+http://`` engine groups; ``ledger`` is the
    shared budget's store (several replicas).
    """
    settings = settings_from_dict({**PROXY_DEFAULTS, **options, "engines": list(engines)})
    app = create_app(settings, resolver=resolver, ledger=ledger)
    with serving(app, "the proxy") as (base_url, port, http):
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


@contextmanager
def spawn_sim(*flags: str, time_scale: float = 20.0) -> Iterator[Process]:
    """Run ``whoseturn sim --profile cpu-tiny --served-model-name tiny FLAGS`` until
    the ``with`` body ends (or :meth:`Process.kill`)."""
    with _spawn(sim_command("--time-scale", str(time_scale), *flags), "/health") as process:
        yield process


@contextmanager
def spawn_proxy(*engine_urls: str) -> Iterator[Process]:
    """Run ``whoseturn serve --engine URL ...`` until the ``with`` body ends; it is
    ready once ``/readyz`` answers 200 (an engine passed a health check)."""
    command = whoseturn_command("serve", *(f"--engine={url}" for url in engine_urls))
    with _spawn(command, "/readyz") as process:
        yield process


@contextmanager
def spawn_proxy_config(config: Path) -> Iterator[Process]:
    """Run ``whoseturn serve --config CONFIG`` until the ``with`` body ends."""
    with _spawn(whoseturn_command("serve", "--config", str(config)), "/readyz") as process:
        yield process


@contextmanager
def _spawn(command: list[str], ready_path: str) -> Iterator[Process]:
    port = free_port()
    base_url = loopback_url(port)
    with (
        running([*command, "--port", str(port)]) as process,
        httpx.Client(base_url=base_url, timeout=10) as http,
    ):
        what = " ".join(command)
        wait_until_ok(
            base_url + ready_path, process=process, what=what, timeout_s=20, interval_s=0.02
        )
        yield Process(base_url=base_url, port=port, http=http, process=process)
