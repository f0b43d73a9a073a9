"""Engines found by DNS join and leave while the proxy is under load, and nothing is lost.

Two simulated engines listen on 127.0.0.2 and 127.0.0.3 at the same port; the
proxy knows them only as ``dns+http://engines.test:PORT``, and the test answers its
look-ups. Chat and batch requests run all along. The second engine joins, with its
group's piecing settings, and takes work; then the first leaves DNS while a long
stream runs there: the stream finishes, no request sent after the leave reaches
it, every request is answered, and once idle the engine is forgotten.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field

import httpx
import pytest

from tests.support.http import data_lines
from tests.support.polling import wait_for

from .proxyserver import ProxyServer, run_proxy
from .simserver import MODEL, SimServer, run_server, sim_settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HOST = "engines.test"
FIRST, SECOND = "127.0.0.2", "127.0.0.3"
TIME_SCALE = 5.0
WORKERS = 4


class Dns:
    """The proxy's resolver: ``engines.test`` has the addresses the test sets."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.calls = 0

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        assert host == HOST
        self.calls += 1
        return list(self.addresses)

    def set(self, *addresses: str) -> None:
        """Change the answer, and return once the proxy has acted on it (a look-up
        began after the one that saw it ended)."""
        self.addresses = list(addresses)
        seen = self.calls
        wait_for(lambda: self.calls >= seen + 2, timeout=10)


@dataclass
class Load:
    """Chat and batch requests, one after another on each worker, until stopped."""

    proxy: ProxyServer
    stop: threading.Event = field(default_factory=threading.Event)
    results: list[tuple[float, str, int]] = field(default_factory=list)  # sent, engine, status

    def run(self, worker: int) -> None:
        with httpx.Client(base_url=self.proxy.base_url, timeout=30) as http:
            n = 0
            while not self.stop.is_set():
                n += 1
                sent = time.monotonic()
                if worker % 2:
                    body = {"model": MODEL, "prompt": f"record {worker}-{n}", "max_tokens": 20}
                    response = http.post("/batch/v1/completions", json=body)
                else:
                    messages = [{"role": "user", "content": f"hello {worker}-{n}"}]
                    body = {"model": MODEL, "messages": messages, "max_tokens": 10}
                    response = http.post("/v1/chat/completions", json=body)
                engine = response.headers.get("x-whoseturn-engine", "")
                self.results.append((sent, engine, response.status_code))

    def engines_since(self, t: float) -> set[str]:
        return {engine for sent, engine, _ in list(self.results) if sent >= t}


@pytest.fixture
def sims() -> Iterator[tuple[SimServer, SimServer]]:
    settings = sim_settings(time_scale=TIME_SCALE)
    with ExitStack() as stack:
        first = stack.enter_context(run_server(settings, host=FIRST))
        second = stack.enter_context(run_server(settings, host=SECOND, port=first.port))
        yield first, second


def test_engines_join_and_leave_by_dns_under_load(sims: tuple[SimServer, SimServer]) -> None:
    first, _ = sims
    dns = Dns(FIRST)
    group = {"url": f"dns+http://{HOST}:{first.port}", "name": "sim", "models": [MODEL]}
    name_1, name_2 = f"sim-{FIRST}", f"sim-{SECOND}"
    with (
        run_proxy([group], resolver=dns, dns_interval_s=0.05, health_interval_s=0.1) as proxy,
        ThreadPoolExecutor(WORKERS) as pool,
    ):
        load = Load(proxy)
        workers = [pool.submit(load.run, w) for w in range(WORKERS)]
        try:
            wait_for(lambda: name_1 in load.engines_since(0), timeout=20)
            request = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "a long story"}],
                "max_tokens": 300,
                "stream": True,
            }
            with proxy.http.stream("POST", "/v1/chat/completions", json=request) as stream:
                assert stream.headers["x-whoseturn-engine"] == name_1
                events = data_lines(stream)
                next(events)

                joined_at = time.monotonic()
                dns.set(FIRST, SECOND)
                wait_for(lambda: name_2 in load.engines_since(joined_at), timeout=20)
                piecing = _piecing(proxy)
                assert set(piecing) == {name_1, name_2}, "a joined engine has no piecing facts"
                assert piecing[name_2]["mode"] == "auto"

                dns.set(SECOND)
                left_at = time.monotonic()
                rest = list(events)
            assert rest[-1] == "[DONE]", "the stream on the engine that left did not finish"
            assert not any('"error"' in e for e in rest)
            wait_for(lambda: len(load.engines_since(left_at)) > 0, timeout=20)
            time.sleep(1.0)  # more work after the leave
            forgotten = wait_for(lambda: name_1 not in _engines(proxy), timeout=20)
        finally:
            load.stop.set()
            for w in workers:
                w.result(timeout=60)

    statuses = [status for _, _, status in load.results]
    assert statuses and set(statuses) == {200}, "a request was lost while engines moved"
    assert load.engines_since(left_at) == {name_2}, "new work reached the engine that left"
    assert first.requests_running() == 0
    assert forgotten < 20


def _piecing(proxy: ProxyServer) -> dict[str, dict[str, object]]:
    """Each engine's piecing facts, as ``/turn`` reports them."""
    engines = proxy.http.get("/turn").json()["engines"]
    return {e["engine"]: e["piecing"] for e in engines if "piecing" in e}


def _engines(proxy: ProxyServer) -> set[str]:
    """The engines the proxy knows now (its ``whoseturn_engine_up`` series)."""
    return {
        dict(labels)["engine"]
        for (name, labels) in proxy.metrics()
        if name == "whoseturn_engine_up"
    }
