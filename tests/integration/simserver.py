"""The simulated engine on a real loopback socket, for the integration tier.

:func:`run_server` serves :func:`loadtests.sim.server.create_sim_app` in a background
thread (:func:`tests.support.served.serve_app`). Tests talk to it over HTTP only,
with httpx or the official ``openai`` client.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from loadtests.sim.profile import load_profile
from loadtests.sim.server import create_sim_app
from loadtests.sim.settings import SimSettings, scheduler_config
from tests.support import MODEL
from tests.support.processes import LOOPBACK
from tests.support.served import Served, serving

__all__ = ["MODEL", "SimServer", "abort_latencies", "run_server", "sim_settings"]


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


@dataclass
class SimServer(Served):
    settings: SimSettings

    def requests_running(self) -> float:
        return self.metric("vllm:num_requests_running")


@contextmanager
def run_server(
    settings: SimSettings, *, host: str = LOOPBACK, port: int = 0
) -> Iterator[SimServer]:
    """Serve the simulated engine on a loopback address (``host``, ``port``; 0: a free
    port) for the ``with`` body."""
    app = create_sim_app(settings)
    with serving(app, "the simulated engine", host=host, port=port) as (base_url, port, http):
        yield SimServer(base_url=base_url, port=port, http=http, settings=settings)


def abort_latencies(
    sim: SimServer, leave: Callable[[], float], *, within_s: float, tries: int
) -> list[float]:
    """Seconds from each hang-up to the engine dropping the request: ``leave()`` starts
    a request, hangs up while the engine runs it and returns when it hung up.

    Tried until one is within ``within_s``, up to ``tries`` times: on two shared cores
    a bound is missed now and then from CPU starvation alone, while an abort that is
    missing or waits for something (the next token, a timeout) misses it every time.
    """
    latencies: list[float] = []
    while len(latencies) < tries and (not latencies or latencies[-1] >= within_s):
        left_at = leave()
        sim.wait_for(lambda: sim.requests_running() == 0, timeout=2)
        latencies.append(time.monotonic() - left_at)
    return latencies


def hang_up_while_running(sim: SimServer, sock: socket.socket, *, after_s: float) -> float:
    """Close ``sock``, whose request ``sim`` must be running ``after_s`` after it began
    to; returns when it was closed (a ``leave`` of :func:`abort_latencies`)."""
    try:
        sim.wait_for(lambda: sim.requests_running() == 1, timeout=2)
        time.sleep(after_s)
        assert sim.requests_running() == 1
    finally:
        sock.close()
    return time.monotonic()
