"""Exactly once on SQLite: a 500-line job survives SIGKILLs of the proxy.

``whoseturn serve`` runs as a child process in front of a fast simulated engine
(another child);
it is killed with SIGKILL at random points while the lines run (twice), and once
while the job is finalizing, and restarted each time on the same store. The job
then completes with exactly one output or error line per ``custom_id``, and its
counts add up.

To kill it *while finalizing* every time, not by luck, the test puts a directory
where the output file's temporary copy goes: finalizing fails there and is
retried, so the job stays ``finalizing`` (the store says so) until the proxy is
killed; the obstacle is removed before the restart.
"""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import free_port, loopback_url, running, serve_command, wait_until_ok

from .proxyserver import Process, engine, spawn_sim
from .simserver import MODEL

pytestmark = pytest.mark.integration
LINES = 500


def job_lines() -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    lines = [
        {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i in range(LINES)
    ]
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def status(store: Path, batch_id: str) -> tuple[str, int]:
    """The job's status and how many lines have a result, read from the store."""
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as db:
        (state,) = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
        sql = "SELECT COUNT(*) FROM lines WHERE batch_id = ? AND result IS NOT NULL"
        (done,) = db.execute(sql, (batch_id,)).fetchone()
    return state, done


def wait(predicate: Any, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.005)


@contextmanager
def serving(tmp: Path, sim: Process, store: Path) -> Iterator[httpx.Client]:
    port = free_port()
    command = serve_command(
        tmp / "proxy.yaml",
        port=port,
        engines=[engine(sim.base_url, "sim-0")],
        batch_store_path=str(store),
        batch_retry_backoff_s=0.01,
    )
    with running(command, stop_signal=signal.SIGKILL, grace_s=5) as process:
        base = loopback_url(port)
        # Up (built, store open), not necessarily ready: the job may keep the engine busy.
        wait_until_ok(base + "/healthz", process=process, what="the proxy", timeout_s=30)
        with httpx.Client(base_url=base, timeout=10) as http:
            yield http


@pytest.mark.timeout(150)
def test_sigkills_at_random_points_lose_and_repeat_nothing(tmp_path: Path) -> None:
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    store = tmp_path / "batch.db"
    with spawn_sim(time_scale=50.0) as sim:
        with serving(tmp_path, sim, store) as http:
            up = http.post("/v1/files", files={"file": ("in.jsonl", job_lines())},
                           data={"purpose": "batch"})  # fmt: skip
            assert up.status_code == 200, up.text
            ask = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
            made = http.post("/v1/batches", json={"input_file_id": up.json()["id"], **ask})
            assert made.status_code == 200, made.text
            batch_id = made.json()["id"]
            # The obstacle for the third kill (see the module docstring).
            Path(f"{store}.files/file-{batch_id}-output.tmp").mkdir()
            at = rng.randrange(30, 150)
            wait(lambda: status(store, batch_id)[1] >= at)
        kills = [(status(store, batch_id), seed)]
        with serving(tmp_path, sim, store):
            at = rng.randrange(kills[0][0][1] + 30, 400)
            wait(lambda: status(store, batch_id)[1] >= at)
        kills.append((status(store, batch_id), seed))
        with serving(tmp_path, sim, store):
            wait(lambda: status(store, batch_id)[0] == "finalizing")
            time.sleep(rng.uniform(0, 0.5))
        kills.append((status(store, batch_id), seed))
        Path(f"{store}.files/file-{batch_id}-output.tmp").rmdir()
        with serving(tmp_path, sim, store) as http:
            wait(lambda: status(store, batch_id)[0] == "completed")
            done = http.get(f"/v1/batches/{batch_id}").json()
            output = http.get(f"/v1/files/{done['output_file_id']}/content").text
            errors = http.get(f"/v1/files/{done['error_file_id']}/content").text
    assert [k[0][0] for k in kills] == ["in_progress", "in_progress", "finalizing"], kills
    assert kills[0][0][1] < kills[1][0][1] < LINES, kills
    ids = [json.loads(x)["custom_id"] for x in (output + errors).splitlines()]
    assert sorted(ids) == sorted(f"line-{i}" for i in range(LINES)), f"seed {seed}"
    counts = done["request_counts"]
    assert counts["total"] == LINES == counts["completed"] + counts["failed"]
    assert counts["completed"] == len(output.splitlines())
    print(f"seed {seed}: killed at {[k[0] for k in kills]}; {counts}")
