"""Exactly once on PostgreSQL, with real processes: ``whoseturn serve`` children in
front of a fast simulated engine (another child), a real PostgreSQL (the session's
test cluster, a fresh database per test).

1. One proxy is killed with SIGKILL at random points while a 500-line job runs
   (twice) and once while it is finalizing, and restarted each time on the same
   database: the job completes with exactly one output or error line per
   ``custom_id`` and its counts add up. To kill it *while finalizing* every time, a
   trigger makes every write of a file chunk fail (finalizing fails and is retried;
   the job stays ``finalizing``) until the proxy is killed; it is dropped before
   the restart.
2. Two proxies share the job; one is killed mid-job; the other claims the dead
   one's lines once their lease runs out and finishes the job, exactly once.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from subprocess import Popen
from typing import Any

import httpx
import psycopg
import pytest

from tests.support.processes import free_port, loopback_url, running, serve_command, wait_until_ok

from .proxyserver import Process, engine, spawn_sim
from .test_batch_crash import LINES, job_lines

pytestmark = pytest.mark.integration
LEASE_S = 2.0
BLOCK_CHUNKS = """
CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS
    $$ BEGIN RAISE EXCEPTION 'the test refuses file chunks'; END $$;
CREATE TRIGGER refuse BEFORE INSERT ON file_chunks FOR EACH ROW EXECUTE FUNCTION refuse();
"""


def wait(predicate: Callable[[], bool], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.005)


def query(dsn: str, sql: str, *params: object) -> list[tuple[Any, ...]]:
    """The rows ``sql`` (with ``params``) gives, on a connection of its own."""
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql, params).fetchall()


def status(dsn: str, batch_id: str) -> tuple[str, int]:
    """The job's status and how many lines have a result, read from the database."""
    ((job_status, done),) = query(
        dsn,
        "SELECT b.status, (SELECT count(*) FROM lines l WHERE l.batch_id = b.id "
        "AND l.result IS NOT NULL) FROM batches b WHERE b.id = %s",
        batch_id,
    )
    return str(job_status), int(done)


def held_by(dsn: str, batch_id: str, owner: str) -> set[int]:
    """The lines ``owner`` has claimed that have no result."""
    sql = "SELECT idx FROM lines WHERE batch_id = %s AND claimed_by = %s AND result IS NULL"
    return {int(i) for (i,) in query(dsn, sql, batch_id, owner)}


def owners(dsn: str, batch_id: str) -> dict[str, int]:
    """Lines claimed and still without a result, by owner."""
    rows = query(
        dsn,
        "SELECT claimed_by, count(*) FROM lines WHERE batch_id = %s "
        "AND claimed_by IS NOT NULL AND result IS NULL GROUP BY claimed_by",
        batch_id,
    )
    return {str(o): int(n) for o, n in rows}


@contextmanager
def serving(
    tmp: Path, sim: Process, dsn: str, name: str = "proxy"
) -> Iterator[tuple[httpx.Client, Popen[bytes]]]:
    port = free_port()
    command = serve_command(
        tmp / f"{name}.yaml",
        port=port,
        engines=[engine(sim.base_url, "sim-0")],
        batch_store="postgres",
        batch_dsn=dsn,
        batch_lease_s=LEASE_S,
        batch_retry_backoff_s=0.01,
    )
    with running(command, stop_signal=signal.SIGKILL, grace_s=5) as process:
        base = loopback_url(port)
        wait_until_ok(base + "/healthz", process=process, what=name, timeout_s=30)
        with httpx.Client(base_url=base, timeout=10) as http:
            yield http, process


def submit(http: httpx.Client) -> str:
    up = http.post(
        "/v1/files", files={"file": ("in.jsonl", job_lines())}, data={"purpose": "batch"}
    )
    assert up.status_code == 200, up.text
    ask = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
    made = http.post("/v1/batches", json={"input_file_id": up.json()["id"], **ask})
    assert made.status_code == 200, made.text
    return str(made.json()["id"])


def check_exactly_once(http: httpx.Client, batch_id: str) -> dict[str, int]:
    """One output or error line per ``custom_id``, and counts that add up."""
    done = http.get(f"/v1/batches/{batch_id}").json()
    assert done["status"] == "completed", done
    output = http.get(f"/v1/files/{done['output_file_id']}/content").text
    errors = http.get(f"/v1/files/{done['error_file_id']}/content").text
    ids = [json.loads(x)["custom_id"] for x in (output + errors).splitlines()]
    assert sorted(ids) == sorted(f"line-{i}" for i in range(LINES))
    counts: dict[str, int] = done["request_counts"]
    assert counts["total"] == LINES == counts["completed"] + counts["failed"]
    assert counts["completed"] == len(output.splitlines())
    return counts


@pytest.mark.timeout(180)
def test_sigkills_at_random_points_lose_and_repeat_nothing(
    tmp_path: Path, postgres_db: str
) -> None:
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    dsn = postgres_db
    with spawn_sim(time_scale=50.0) as sim:
        with serving(tmp_path, sim, dsn) as (http, _):
            batch_id = submit(http)
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(BLOCK_CHUNKS)  # the obstacle for the third kill
            at = rng.randrange(30, 150)
            wait(lambda: status(dsn, batch_id)[1] >= at)
        kills = [status(dsn, batch_id)]
        with serving(tmp_path, sim, dsn):
            at = rng.randrange(kills[0][1] + 30, 400)
            wait(lambda: status(dsn, batch_id)[1] >= at)
        kills.append(status(dsn, batch_id))
        with serving(tmp_path, sim, dsn):
            wait(lambda: status(dsn, batch_id)[0] == "finalizing")
            time.sleep(rng.uniform(0, 0.5))
        kills.append(status(dsn, batch_id))
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DROP TRIGGER refuse ON file_chunks")
        with serving(tmp_path, sim, dsn) as (http, _):
            wait(lambda: status(dsn, batch_id)[0] == "completed")
            counts = check_exactly_once(http, batch_id)
    assert [k[0] for k in kills] == ["in_progress", "in_progress", "finalizing"], (kills, seed)
    assert kills[0][1] < kills[1][1] < LINES, (kills, seed)
    print(f"seed {seed}: killed at {kills}; {counts}")


@pytest.mark.timeout(180)
def test_two_replicas_share_a_job_and_the_survivor_finishes_it(
    tmp_path: Path, postgres_db: str
) -> None:
    dsn = postgres_db
    host = socket.gethostname()
    with (
        spawn_sim(time_scale=20.0) as sim,
        serving(tmp_path, sim, dsn, "survivor") as (http, survivor),
        serving(tmp_path, sim, dsn, "victim") as (victim_http, victim),
    ):
        batch_id = submit(victim_http)
        victim_id, survivor_id = f"{host}-{victim.pid}", f"{host}-{survivor.pid}"
        # Both replicas are running lines of the job, and some are done.
        wait(lambda: set(owners(dsn, batch_id)) == {victim_id, survivor_id})
        wait(lambda: status(dsn, batch_id)[1] >= 100)
        victim.send_signal(signal.SIGKILL)
        victim.wait(5)
        held = held_by(dsn, batch_id, victim_id)
        killed_at = status(dsn, batch_id)
        assert killed_at[0] == "in_progress" and held, (killed_at, held)
        wait(lambda: status(dsn, batch_id)[0] == "completed", timeout_s=120)
        counts = check_exactly_once(http, batch_id)
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(
                "SELECT idx, claimed_by FROM lines WHERE batch_id = %s AND idx = ANY(%s) "
                "AND result IS NOT NULL",
                (batch_id, sorted(held)),
            ).fetchall()
    # The lines the victim held when it died were claimed again and run by the survivor.
    assert {idx for idx, _ in rows} == held and {o for _, o in rows} == {survivor_id}
    print(f"killed at {killed_at} holding {len(held)} lines; {counts}")
