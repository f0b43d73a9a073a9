"""The batch runner outlives PostgreSQL outages, with real processes: ``whoseturn
serve`` (a child) in front of a simulated engine (another child), on a PostgreSQL
cluster of the test's own, which the test restarts twice and pauses (SIGSTOP of
every server process) twice while a job runs.

During each outage the Files and Batches routes answer at once (503 with
``Retry-After``, never a hang: every call is timed, the slowest must be under 1 s),
``/readyz`` says the store is down (and stays 200: chat does not need the store),
and afterwards the job goes on by itself: it completes with exactly one output
line per ``custom_id``, its counts add up, and no line reached the engine twice
(the simulated engine's request log).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import DEVNULL
from typing import IO, Any

import httpx
import pytest

from loadtests.sim.server.requestlog import RequestLogReader
from tests.support.postgres import Cluster, fresh_database, paused, postgres_cluster, start, stop
from tests.support.processes import free_port, loopback_url, running, serve_command, wait_until_ok

from .proxyserver import Process, engine, spawn_sim
from .simserver import MODEL
from .test_batch_crash import job_lines as crash_job_lines
from .test_batch_postgres import status

pytestmark = pytest.mark.integration
LINES = 400
OUTAGE_S = 3.0
FAST_S = 1.0  # the bound on any Files/Batches call during an outage


def job_lines() -> bytes:
    return crash_job_lines(LINES, max_tokens=8)


def wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@dataclass
class Calls:
    """Files/Batches calls made while an outage lasts: status and seconds of each."""

    seen: list[tuple[str, int, float]] = field(default_factory=list)
    retry_after: set[str] = field(default_factory=set)
    store_down_on_readyz: int = 0


@contextmanager
def calling(base: str, batch_id: str, file_id: str) -> Iterator[Calls]:
    """Call the routes in a loop on a thread while the block runs."""
    calls = Calls()
    done = threading.Event()

    def loop() -> None:
        paths = [f"/v1/batches/{batch_id}", "/v1/batches", "/v1/files", f"/v1/files/{file_id}"]
        with httpx.Client(base_url=base, timeout=10) as http:
            while not done.is_set():
                for path in [*paths, "upload"]:
                    began = time.monotonic()
                    if path == "upload":
                        got = http.post(
                            "/v1/files",
                            files={"file": ("more.jsonl", job_lines()[:300])},
                            data={"purpose": "batch"},
                        )
                    else:
                        got = http.get(path)
                    calls.seen.append((path, got.status_code, time.monotonic() - began))
                    if got.status_code == 503:
                        calls.retry_after.add(got.headers.get("retry-after", ""))
                ready = http.get("/readyz")
                store = ready.json().get("batch_store") or {}
                if ready.status_code == 200 and store.get("up") is False:
                    calls.store_down_on_readyz += 1
                time.sleep(0.05)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield calls
    finally:
        done.set()
        thread.join(15)


def restart(cluster: Cluster) -> None:
    stop(cluster)
    time.sleep(OUTAGE_S)
    start(cluster)


def pause(cluster: Cluster) -> None:
    with paused(cluster):
        time.sleep(OUTAGE_S)


@contextmanager
def proxy_on_postgres(
    tmp_path: Path, sim: Process, dsn: str, *, output: IO[bytes] | int = DEVNULL, **settings: Any
) -> Iterator[str]:
    """``whoseturn serve`` (a child, its output to ``output``) in front of ``sim``, its
    batch store the PostgreSQL database ``dsn``, with ``settings``; yields its URL once
    ``/healthz`` answers, and stops it with ``SIGTERM`` (20 s to drain) after."""
    port = free_port()
    command = serve_command(
        tmp_path / "proxy.yaml",
        port=port,
        engines=[engine(sim.base_url, "sim-0")],
        batch_store="postgres",
        batch_dsn=dsn,
        **settings,
    )
    with running(command, output=output, stop_signal=signal.SIGTERM, grace_s=20) as process:
        base = loopback_url(port)
        wait_until_ok(base + "/healthz", process=process, what="proxy", timeout_s=30)
        yield base


@pytest.mark.timeout(240)
def test_the_job_outlives_restarts_and_pauses_of_the_database(tmp_path: Path) -> None:
    engine_log = tmp_path / "engine.jsonl"
    with (
        postgres_cluster() as cluster,
        spawn_sim("--request-log", str(engine_log), time_scale=4.0) as sim,
    ):
        dsn = fresh_database(cluster.dsn())
        log = tmp_path / "proxy.log"
        with (
            log.open("wb") as output,
            proxy_on_postgres(tmp_path, sim, dsn, output=output, batch_window=16) as base,
            httpx.Client(base_url=base, timeout=10) as http,
        ):
            up = http.post(
                "/v1/files",
                files={"file": ("in.jsonl", job_lines())},
                data={"purpose": "batch"},
            )
            assert up.status_code == 200, up.text
            file_id = up.json()["id"]
            ask = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
            made = http.post("/v1/batches", json={"input_file_id": file_id, **ask})
            assert made.status_code == 200, made.text
            batch_id = made.json()["id"]

            outages = [restart, pause, restart, pause]
            progress: list[int] = []
            for number, outage in enumerate(outages):
                # the job in flight: some lines recorded since the last outage
                mark = status(dsn, batch_id)[1] if progress else 0
                wait(
                    lambda m=mark: status(dsn, batch_id)[1] >= m + 10,
                    60,
                    f"progress (the proxy's log: {log})",
                )
                state, done = status(dsn, batch_id)
                assert state == "in_progress" and done < LINES, (
                    f"the job was not in flight before outage {number + 1}: {state}, "
                    f"{done}/{LINES} (the engine is too fast for this test)"
                )
                progress.append(done)
                with calling(base, batch_id, file_id) as calls:
                    outage(cluster)
                slowest = max(s for _, _, s in calls.seen)
                statuses = {code for _, code, _ in calls.seen}
                print(
                    f"outage {number + 1} ({outage.__name__}) at {done}/{LINES}: "
                    f"{len(calls.seen)} calls, slowest {slowest:.3f} s, statuses "
                    f"{sorted(statuses)}, Retry-After {sorted(calls.retry_after)}"
                )
                assert slowest < FAST_S, calls.seen
                assert 503 in statuses and statuses <= {200, 503}, statuses
                assert calls.retry_after and "" not in calls.retry_after
                assert calls.store_down_on_readyz > 0

            wait(lambda: status(dsn, batch_id)[0] == "completed", 120, "completion")
            done = http.get(f"/v1/batches/{batch_id}").json()
            output = http.get(f"/v1/files/{done['output_file_id']}/content").text
            ids = [json.loads(x)["custom_id"] for x in output.splitlines()]
            assert sorted(ids) == sorted(f"line-{i}" for i in range(LINES))  # once each
            counts = done["request_counts"]
            assert (counts["total"], counts["completed"], counts["failed"]) == (LINES, LINES, 0)
            ready = http.get("/readyz").json()
            assert ready["batch_store"]["up"] is True
            assert ready["batch_store"]["outages"] >= len(outages)
            metrics = http.get("/metrics").text
            assert "whoseturn_batch_store_up 1.0" in metrics
        print(f"lines recorded before each outage: {progress}")
    # No line was run twice: an answer whose record failed in an outage was kept
    # and recorded after it, not asked again.
    calls = Tally(r.user for r in RequestLogReader(engine_log).read())
    assert set(calls) == {f"line-{i}" for i in range(LINES)}
    assert [u for u, n in calls.items() if n > 1] == [], calls.most_common(5)


@pytest.mark.timeout(120)
def test_the_proxy_starts_while_the_database_is_down_and_finds_it_later(
    tmp_path: Path,
) -> None:
    """Chat does not need the batch store: a proxy started while PostgreSQL is down
    serves chat, says the store is down, and opens it once it answers."""
    with postgres_cluster() as cluster, spawn_sim(time_scale=20.0) as sim:
        dsn = fresh_database(cluster.dsn())
        stop(cluster)
        began = time.monotonic()
        with proxy_on_postgres(tmp_path, sim, dsn) as base:
            print(f"started in {time.monotonic() - began:.1f} s with the database down")
            with httpx.Client(base_url=base, timeout=10) as http:
                chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                assert http.post("/v1/chat/completions", json=chat).status_code == 200
                ready = http.get("/readyz")
                assert ready.status_code == 200
                assert ready.json()["batch_store"]["up"] is False
                listed = http.get("/v1/files")
                assert listed.status_code == 503 and listed.headers["retry-after"]
                start(cluster)
                wait(lambda: http.get("/readyz").json()["batch_store"]["up"], 30, "the store")
                up = http.post(
                    "/v1/files",
                    files={"file": ("in.jsonl", job_lines()[:2000])},
                    data={"purpose": "batch"},
                )
                assert up.status_code == 200, up.text
                assert http.get("/v1/files").json()["data"][0]["id"] == up.json()["id"]
