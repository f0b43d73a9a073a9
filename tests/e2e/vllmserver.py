"""Real vLLM servers (the CPU build) for the e2e tier, started as tests need them.

:class:`VllmFleet` starts ``python -m vllm.entrypoints.openai.api_server`` from
``.venv-vllm`` with the small model that ``e2e/build_tiny_model.py`` builds (both made
by ``make test-e2e``), one server per set of extra flags, on a free loopback port. A
server is ready once ``/health`` answers 200 (up to ``READY_TIMEOUT_S``: the first
start on a machine compiles; later ones reuse vLLM's cache). Each server writes its
log to ``artifacts/e2e/``. At most ``max_alive`` servers run at once (two cores): a
new one stops the least recently used. :meth:`VllmServer.stop` sends ``SIGTERM`` to
the server's process group (the API server, its engine core and worker), then
``SIGKILL`` after ``STOP_TIMEOUT_S``.

Starting and stopping a server is :mod:`loadtests.support.vllm`'s (the comparison harness
starts servers the same way). :func:`proxy_in_front` serves the proxy in front of
running servers. Tests talk to the
servers over HTTP only; nothing here imports vllm or torch.
Environment: ``WHOSETURN_E2E_VLLM_PYTHON`` (default ``.venv-vllm/bin/python``),
``WHOSETURN_E2E_MODEL`` (default ``.cache/tiny-model``),
``WHOSETURN_E2E_READY_TIMEOUT_S`` (default 180).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtests.support.vllm import READY_TIMEOUT_S, REPO, STOP_TIMEOUT_S, VllmProcess, start_vllm
from tests.integration.proxyserver import ProxyServer, engine, run_proxy
from tests.support.served import Served

LOG_DIR = REPO / "artifacts" / "e2e"
# A test that may start a server gets this much time on top of its own.
STARTUP_ALLOWANCE_S = READY_TIMEOUT_S + STOP_TIMEOUT_S
# The proxy scrapes a real engine's /metrics less often than a simulated one's: each
# scrape costs the engine's API server CPU time on two shared cores.
PROXY_OPTIONS: dict[str, Any] = {"scrape_interval_s": 0.5, "health_interval_s": 1.0}


@dataclass
class VllmServer(Served):
    """One running vLLM API server, with an HTTP client for it."""

    engine: VllmProcess

    @property
    def flags(self) -> tuple[str, ...]:
        return self.engine.flags

    @property
    def ready_after_s(self) -> float:
        return self.engine.ready_after_s

    def alive(self) -> bool:
        return self.engine.process.poll() is None

    def running(self) -> float:
        """``vllm:num_requests_running``, summed over the engine's label sets."""
        return self.metric("vllm:num_requests_running")

    def stop(self) -> None:
        self.http.close()
        self.engine.stop()


@dataclass
class VllmFleet:
    """The session's vLLM servers, one per tuple of extra flags, started on demand.

    At most ``max_alive`` run at once (two cores): a new one stops the least
    recently used.
    """

    max_alive: int = 1
    starts: list[tuple[tuple[str, ...], float]] = field(default_factory=list)
    _alive: OrderedDict[tuple[str, ...], VllmServer] = field(default_factory=OrderedDict)

    def get(self, *flags: str) -> VllmServer:
        """A ready server started with ``flags`` (``--scheduling-policy priority`` ...)."""
        if flags in self._alive:
            self._alive.move_to_end(flags)
            server = self._alive[flags]
            if server.alive():
                return server
            del self._alive[flags]
        while len(self._alive) >= self.max_alive:
            _, oldest = self._alive.popitem(last=False)
            oldest.stop()
        process = start_vllm(flags, LOG_DIR, index=len(self.starts))
        http = httpx.Client(base_url=process.base_url, timeout=30)
        server = VllmServer(base_url=process.base_url, port=process.port, http=http, engine=process)
        self.starts.append((flags, server.ready_after_s))
        self._alive[flags] = server
        return server

    def stop_all(self) -> None:
        while self._alive:
            _, server = self._alive.popitem()
            server.stop()


@contextmanager
def proxy_in_front(*servers: VllmServer, **options: Any) -> Iterator[ProxyServer]:
    """The proxy (in this process, on a loopback socket) in front of ``servers``,
    named ``vllm-0``, ``vllm-1``, ...; ``options`` are top-level proxy settings.

    An engine started with ``--scheduling-policy priority`` is declared so, so that
    the proxy sends each request's priority.
    """
    engines = [
        engine(server.base_url, f"vllm-{i}", scheduling_policy=_policy(server.flags))
        for i, server in enumerate(servers)
    ]
    with run_proxy(engines, **{**PROXY_OPTIONS, **options}) as proxy:
        yield proxy


def _policy(flags: tuple[str, ...]) -> str:
    joined = " ".join(flags).replace("=", " ")
    return "priority" if "--scheduling-policy priority" in joined else "fcfs"
