"""Two proxy replicas share one engine's budget through a real PostgreSQL ledger, and
the database goes away: restarted twice (stopped, then started again) and paused
twice (``SIGSTOP`` of the server and every backend: connections stay open and
nothing answers).

Batch and chat requests run against both replicas the whole time. While the
ledger is down each replica says so (``/turn``'s ``ledger``, the
``whoseturn_ledger_up`` gauge, one warning) and batch keeps completing on its local
share of the budget: the engine itself never holds more batch prompt tokens in
prefill than the budget. Chat, ``/turn`` and ``/metrics`` answer fast throughout.
After each outage both replicas are back in the ledger by themselves, each
counting the other again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

import httpx
import pytest

from tests.support.polling import wait_for
from tests.support.postgres import Cluster, fresh_database, paused, postgres_cluster, start, stop

from .proxyserver import ProxyServer, engine, run_proxy
from .simserver import MODEL, SimServer, run_server, sim_settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BUDGET = 400  # batch prompt tokens in prefill on the engine, over both replicas
PROMPT = 100  # each batch prompt's tokens: two fit in a replica's local share
OUTAGE_S = 3.0  # longer than the lease: each replica's rows age out meanwhile
LEDGER = {"ledger_interval_s": 0.05, "ledger_lease_s": 1.0, "ledger_timeout_s": 0.6}
FAST_S = 1.0  # the bar for a chat answer, /turn and /metrics during an outage
PEAK = "whoseturn_sim_prefill_prompt_tokens_peak"


@dataclass
class Load:
    """What the clients saw: batch completions (time, replica), chat answers (time
    sent, seconds, replica), and any request that failed."""

    batch: list[tuple[float, int]] = field(default_factory=list)
    chat: list[tuple[float, float, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def batch_between(self, replica: int, start: float, end: float) -> int:
        return sum(1 for t, r in self.batch if r == replica and start <= t <= end)


async def _batch_loop(http: httpx.AsyncClient, url: str, replica: int, n: int, load: Load) -> None:
    for k in itertools.count():
        if load.stop.is_set():
            return
        prompt = [(n * 13 + k * 7 + i) % 300 + 10 for i in range(PROMPT)]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
        r = await http.post(url + "/batch/v1/completions", json=body)
        if r.status_code == 200:
            load.batch.append((time.monotonic(), replica))
        else:
            load.errors.append(f"batch on replica {replica}: {r.status_code} {r.text[:200]}")


async def _chat_loop(http: httpx.AsyncClient, url: str, replica: int, load: Load) -> None:
    for k in itertools.count():
        if load.stop.is_set():
            return
        body = {"model": MODEL, "max_tokens": 4,
                "messages": [{"role": "user", "content": f"question {replica}-{k}"}]}  # fmt: skip
        sent = time.monotonic()
        r = await http.post(url + "/v1/chat/completions", json=body)
        load.chat.append((sent, time.monotonic() - sent, replica))
        if r.status_code != 200:
            load.errors.append(f"chat on replica {replica}: {r.status_code} {r.text[:200]}")
        await asyncio.sleep(0.05)


async def _run(urls: list[str], load: Load) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        tasks = [_batch_loop(http, url, r, n, load) for r, url in enumerate(urls) for n in range(4)]
        tasks += [_chat_loop(http, url, r, load) for r, url in enumerate(urls)]
        await asyncio.gather(*tasks)


@contextmanager
def running_load(replicas: list[ProxyServer]) -> Iterator[Load]:
    load = Load()
    thread = threading.Thread(
        target=asyncio.run, args=(_run([r.base_url for r in replicas], load),)
    )
    thread.start()
    try:
        yield load
    finally:
        load.stop.set()
        thread.join(60)


def until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``predicate`` every 20 ms; the seconds it took. Fails after ``timeout_s``."""
    return wait_for(predicate, timeout_s, what=what, interval_s=0.02)


class Probe:
    """Reads of one replica's ``/turn`` and ``/metrics``, each timed."""

    def __init__(self, replica: ProxyServer) -> None:
        self.replica = replica
        self.slowest_s = 0.0

    def _get(self, path: str) -> httpx.Response:
        started = time.monotonic()
        r = self.replica.http.get(path, timeout=10)
        self.slowest_s = max(self.slowest_s, time.monotonic() - started)
        r.raise_for_status()
        return r

    def ledger(self) -> dict[str, object]:
        body: dict[str, object] = self._get("/turn").json()["ledger"]
        return body

    def gauge(self, name: str) -> float:
        text = self._get("/metrics").text
        return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name))

    def up(self) -> bool:
        return self.ledger()["up"] is True and self.gauge("whoseturn_ledger_up ") == 1.0

    def down(self) -> bool:
        ledger = self.ledger()
        return (
            ledger["up"] is False
            and bool(ledger["cause"])
            and self.gauge("whoseturn_ledger_up ") == 0.0
        )

    def sees_the_other(self) -> bool:
        engines = self.ledger()["engines"]
        assert isinstance(engines, dict)
        return bool(engines["a"]["replicas"] == 2)


def restarted(cluster: Cluster) -> AbstractContextManager[None]:
    @contextmanager
    def outage() -> Iterator[None]:
        stop(cluster)
        try:
            yield
        finally:
            start(cluster)

    return outage()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """A PostgreSQL of this test's own: it is stopped and paused, which no other test
    sharing the session's server should see."""
    with postgres_cluster() as c:
        yield c


@pytest.fixture
def sim() -> Iterator[SimServer]:
    """An engine that tells batch (priority 0) from chat, so it can count batch
    prompt tokens in prefill on its own."""
    with run_server(sim_settings(time_scale=2.0, scheduling_policy="priority")) as server:
        yield server


def test_two_replicas_ride_out_ledger_outages(
    cluster: Cluster, sim: SimServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.replicas._shared")
    dsn = fresh_database(cluster.dsn())
    budget = {"initial_tokens": BUDGET, "min_tokens": BUDGET, "max_tokens": BUDGET}
    engines = [engine(sim.base_url, "a", budget=budget, scheduling_policy="priority")]
    with (
        run_proxy(engines, ledger_dsn=dsn, replica_id="r0", **LEDGER) as r0,
        run_proxy(engines, ledger_dsn=dsn, replica_id="r1", **LEDGER) as r1,
    ):
        replicas, probes = [r0, r1], [Probe(r0), Probe(r1)]
        until(lambda: all(p.sees_the_other() for p in probes), 5, "each sees the other")
        outages = [
            ("restarted", lambda: restarted(cluster)),
            ("paused", lambda: paused(cluster)),
            ("restarted", lambda: restarted(cluster)),
            ("paused", lambda: paused(cluster)),
        ]
        report: list[str] = []
        with running_load(replicas) as load:
            until(lambda: len(load.batch) >= 10, 10, "batch work before the first outage")
            for what, outage in outages:
                local_before = [
                    p.gauge("whoseturn_ledger_local_reservations_total") for p in probes
                ]
                with outage():
                    began = time.monotonic()
                    took = until(lambda: all(p.down() for p in probes), 3, f"{what}: said so")
                    seen_down = time.monotonic()
                    time.sleep(max(0.0, OUTAGE_S - (seen_down - began)))
                    ended = time.monotonic()
                done = [load.batch_between(r, seen_down, ended) for r in (0, 1)]
                local = [
                    p.gauge("whoseturn_ledger_local_reservations_total") - before
                    for p, before in zip(probes, local_before, strict=True)
                ]
                back = until(lambda: all(p.up() for p in probes), 5, f"{what}: back")
                until(lambda: all(p.sees_the_other() for p in probes), 5, f"{what}: together")
                report.append(
                    f"{what}: down seen in {took:.2f} s, batch done while down {done}, "
                    f"local reservations {local}, back in {back:.2f} s"
                )
                assert min(done) > 0, f"{what}: a replica completed no batch while down"
                assert min(local) > 0
            # after the last outage the replicas count each other's batch again
            others = [0.0, 0.0]
            deadline = time.monotonic() + 5
            while min(others) == 0 and time.monotonic() < deadline:
                for n, p in enumerate(probes):
                    others[n] = max(others[n], p.gauge("whoseturn_replicas_batch_prefill_tokens"))
                time.sleep(0.01)
        peak = sim.metric(PEAK, priority="0")
    slowest_chat = max(seconds for _, seconds, _ in load.chat)
    slowest_read = max(p.slowest_s for p in probes)
    report.append(f"slowest chat {slowest_chat:.3f} s, /turn or /metrics {slowest_read:.3f} s")
    report.append(f"engine peak batch prefill {peak:g} of {BUDGET}; batch done {len(load.batch)}")
    print("\n".join(report))
    assert load.errors == []
    assert min(others) > 0, "a replica never saw the other's batch tokens after the outages"
    assert peak <= BUDGET, f"the engine held {peak} batch prompt tokens in prefill"
    assert slowest_chat < FAST_S, f"a chat took {slowest_chat:.2f} s"
    assert {r for _, _, r in load.chat} == {0, 1}
    assert slowest_read < FAST_S
    logged = [r.getMessage() for r in caplog.records if r.name == "proxy.replicas._shared"]
    # each replica says each outage once, and says its end; a call slower than the
    # timeout on a loaded machine may make one more, short, outage: said and ended too
    downs = sum("shared ledger down" in m for m in logged)
    assert downs >= 2 * len(outages)
    assert sum("shared ledger back after" in m for m in logged) == downs
