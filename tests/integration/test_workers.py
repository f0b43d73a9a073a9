"""``whoseturn serve --workers 2`` as a real process tree, with the ledger on a real
PostgreSQL, in front of a simulated engine: both workers answer on the one port,
each a replica of its own in the ledger; SIGTERM drains both and the parent exits 0
(each worker removed its rows, as a replica that stops cleanly does); a worker
killed makes the parent stop the other and exit 1; workers whose parent is killed
drain and exit."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psycopg
import pytest

from loadtests.bench.overhead import children
from tests.integration.proxyserver import PROXY_DEFAULTS, engine
from tests.integration.simserver import SimServer
from tests.support import MODEL
from tests.support.children import logged_proxy
from tests.support.polling import wait_for
from tests.support.processes import Child

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REPLICAS = {"t-w0", "t-w1"}
DRAIN_LOG = "proxy.process.uvicorn_server: draining"  # a worker's drain begins


def worker_pids(parent: int) -> list[int]:
    """The parent's worker processes (not multiprocessing's resource tracker)."""
    found = []
    for pid in children(parent):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                found.append(pid)
    return found


def ledger_replicas(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT DISTINCT replica FROM whoseturn_ledger").fetchall()
    return {r[0] for r in rows}


@contextmanager
def two_workers(sim: SimServer, dsn: str, tmp_path: Path) -> Iterator[tuple[Child, str]]:
    settings = {**PROXY_DEFAULTS, "ledger_dsn": dsn, "replica_id": "t", "drain_timeout_s": 2}
    engines = [engine(sim.base_url, "e0")]
    flags = ["--workers", "2"]
    with logged_proxy(
        tmp_path, engines, name="whoseturn", flags=flags, timeout_s=90, **settings
    ) as (child, url):
        yield child, url


def replicas_answering(url: str, timeout_s: float = 60.0) -> set[str]:
    """The replica names ``/turn`` gives, each asked on a new connection (so the
    kernel picks a worker each time), until both workers have answered."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while seen != REPLICAS and time.monotonic() < deadline:
        seen.add(httpx.get(url + "/turn", timeout=10).json()["replica"])
    return seen


def test_two_workers_share_one_port_and_the_ledger_and_drain_on_sigterm(
    sim: SimServer, postgres_db: str, tmp_path: Path
) -> None:
    with two_workers(sim, postgres_db, tmp_path) as (child, url):
        pids = worker_pids(child.process.pid)
        assert len(pids) == 2 and child.process.pid not in pids
        assert replicas_answering(url) == REPLICAS, child.tail()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for route in ("/v1", "/batch/v1") * 3:  # batch reserves in the ledger first
            answer = httpx.post(f"{url}{route}/chat/completions", json=body, timeout=30)
            assert answer.status_code == 200, answer.text
        assert ledger_replicas(postgres_db) == REPLICAS
        child.process.send_signal(signal.SIGTERM)
        assert child.process.wait(60) == 0, child.tail()
        log = child.log.read_text()
    assert f"w0 {DRAIN_LOG}" in log and f"w1 {DRAIN_LOG}" in log
    assert ledger_replicas(postgres_db) == set(), "a worker did not stop cleanly"
    wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), timeout=5)


def test_a_worker_that_dies_stops_the_others_and_the_parent_fails(
    sim: SimServer, postgres_db: str, tmp_path: Path
) -> None:
    with two_workers(sim, postgres_db, tmp_path) as (child, url):
        assert replicas_answering(url) == REPLICAS  # both serving, so both can drain
        victim, other = worker_pids(child.process.pid)
        os.kill(victim, signal.SIGKILL)
        assert child.process.wait(60) == 1, child.tail()
        log = child.log.read_text()
    assert f"(pid {victim}) exited with status -9; stopping the others" in log
    assert log.count(DRAIN_LOG) == 1, "the other worker was not drained"
    wait_for(lambda: not Path(f"/proc/{other}").exists(), timeout=5)


def test_workers_drain_when_their_parent_is_killed(
    sim: SimServer, postgres_db: str, tmp_path: Path
) -> None:
    with two_workers(sim, postgres_db, tmp_path) as (child, url):
        # both serving (one answering /readyz says nothing of the other, which on a
        # busy machine may still be starting: killed then, it has nothing to drain)
        assert replicas_answering(url) == REPLICAS
        pids = worker_pids(child.process.pid)
        child.process.kill()
        child.process.wait(10)
        wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), timeout=30)
        log = child.log.read_text()
    assert log.count(DRAIN_LOG) == 2, "the workers were killed, not drained"
