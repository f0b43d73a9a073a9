"""A simulated engine on a real loopback socket, and helpers to read its /metrics.

:func:`run_server` starts :func:`loadtests.sim.server.create_sim_app` under uvicorn in a
background thread on a free port and stops it on exit; :func:`serve_app` does the
same for any ASGI app (the proxy's tests use it). Tests talk to the servers over
HTTP only, with httpx or the official ``openai`` client.
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
from prometheus_client.parser import text_string_to_metric_families

from loadtests.sim.profile import load_profile
from loadtests.sim.server import create_sim_app
from loadtests.sim.settings import SimSettings, scheduler_config

MODEL = "tiny"


def sim_settings(
    *, time_scale: float = 20.0, max_model_len: int = 2048, scheduling_policy: str = "fcfs"
) -> SimSettings:
    """The ``cpu-tiny`` profile with a small context."""
    profile = load_profile("cpu-tiny")
    config = scheduler_config(
        profile, max_model_len=max_model_len, scheduling_policy=scheduling_policy
    )
    return SimSettings(
        profile=profile, scheduler=config, served_model_name=MODEL, time_scale=time_scale
    )


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Samples of a Prometheus exposition, keyed by sample name and label set."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@dataclass
class Served:
    """A server on a loopback port, with a client for it and its /metrics."""

    base_url: str
    port: int
    http: httpx.Client

    def openai(self, **options: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="x", max_retries=0, **options)

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        response = self.http.get("/metrics")
        response.raise_for_status()
        return parse_metrics(response.text)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples called ``name`` whose labels include ``labels``."""
        wanted = set(labels.items())
        found = [v for (n, ls), v in self.metrics().items() if n == name and wanted <= ls]
        if not found:
            raise KeyError(f"no sample {name} with labels {labels}")
        return sum(found)

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> float:
        """Poll until ``predicate()`` holds; returns the seconds it took."""
        start = time.monotonic()
        while not predicate():
            if time.monotonic() - start > timeout:
                raise AssertionError(f"condition not met within {timeout} s")
            time.sleep(0.002)
        return time.monotonic() - start


@dataclass
class SimServer(Served):
    settings: SimSettings


@contextmanager
def serve_app(app: Any, what: str = "the server") -> Iterator[tuple[str, int]]:
    """Serve the ASGI ``app`` on a free loopback port; yields its base URL and port."""
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are
    # TCP, and without it every keep-alive response waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start")
            time.sleep(0.01)
        yield base_url, port
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@contextmanager
def run_server(settings: SimSettings) -> Iterator[SimServer]:
    """Serve the simulated engine on a free loopback port for the ``with`` body."""
    with (
        serve_app(create_sim_app(settings), "the simulated engine") as (base_url, port),
        httpx.Client(base_url=base_url, timeout=10) as http,
    ):
        yield SimServer(base_url=base_url, port=port, http=http, settings=settings)
