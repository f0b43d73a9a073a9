"""``whoseturn serve --workers 2`` on one box with no database server: the workers
share each engine's budget through a SQLite ledger in the data directory, and the
Batch API's SQLite store, as real processes in front of simulated engines.

The budget is read where it matters, at the engines: each engine's most batch
prompt tokens in prefill, as the engine itself counts them, never exceeds its
budget, while both workers send batch work. A batch job submitted to the one port
runs on both workers' runners (each line leased to one of them) and every line has
exactly one result; one scrape of ``/metrics``, and one ``/turn``, answers for both
workers."""

from __future__ import annotations

import asyncio
import io
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtests.bench.replicas import Plan, engine_peaks, engines, proxies, run_load
from tests.integration.simserver import SimServer
from tests.support import MODEL
from tests.support.children import logged_proxy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PLAN = Plan(budget=400, batch_prompt=200, duration_s=6.0, lease_s=1.0)


def workers_answering(url: str, want: int = 2, timeout_s: float = 60.0) -> set[str]:
    """The replica names ``/turn`` gives, each asked on a new connection (so the
    kernel picks a worker each time), until ``want`` have answered."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(seen) < want and time.monotonic() < deadline:
        seen.add(httpx.get(url + "/turn", timeout=10).json()["replica"])
    return seen


def budget_by_worker(text: str) -> dict[str | None, float]:
    """``whoseturn_prefill_budget_tokens`` of engine e0, by the ``worker`` label."""
    return {
        s.labels.get("worker"): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "whoseturn_prefill_budget_tokens" and s.labels.get("engine") == "e0"
    }


def test_two_workers_hold_each_engines_budget_with_no_database(tmp_path: Path) -> None:
    with (
        engines(PLAN) as sims,
        proxies(PLAN, [s.url for s in sims], 1, None, tmp_path, workers=2) as (box,),
    ):
        assert workers_answering(box.url) == {"r0-w0", "r0-w1"}
        ledger = tmp_path / "replica-0-data" / "ledger.sqlite3"
        tally, _, _ = asyncio.run(run_load(PLAN, [box]))
        peaks = engine_peaks(sims)
        with sqlite3.connect(ledger) as db:
            rows = {r[0] for r in db.execute("SELECT DISTINCT replica FROM ledger")}
    assert len(tally.batch_done) > 10 and tally.errors == 0
    assert rows == {"r0-w0", "r0-w1"}, "both workers publish in the one ledger file"
    assert min(peaks) > 0, f"an engine never had batch work: {peaks}"
    assert max(peaks) <= PLAN.budget, f"engines held {peaks} batch tokens in prefill"


def test_a_batch_job_runs_on_both_workers_and_records_each_line_once(
    sim: SimServer, tmp_path: Path
) -> None:
    n = 240
    ids = [f"line-{i}" for i in range(n)]
    lines = [
        {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": MODEL, "messages": [{"role": "user", "content": custom_id}],
                  "max_tokens": 4}}
        for custom_id in ids
    ]  # fmt: skip
    data = tmp_path / "data"
    engine = {"url": sim.base_url, "name": "e0", "models": [MODEL]}
    settings: dict[str, Any] = {"replica_id": "t", "data_dir": str(data), "scrape_interval_s": 0.2}
    flags = ["--workers", "2"]
    with logged_proxy(tmp_path, [engine], flags=flags, timeout_s=90, **settings) as (child, url):
        assert workers_answering(url) == {"t-w0", "t-w1"}, child.tail()
        with httpx.Client(base_url=url, timeout=30) as http:
            body = "".join(json.dumps(x) + "\n" for x in lines).encode()
            files = {"file": ("in.jsonl", io.BytesIO(body), "application/jsonl")}
            upload = http.post("/v1/files", data={"purpose": "batch"}, files=files)
            assert upload.status_code == 200, upload.text
            created = http.post(
                "/v1/batches",
                json={"input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions",
                      "completion_window": "24h"},
            )  # fmt: skip
            assert created.status_code == 200, created.text
            batch_id = created.json()["id"]
            deadline = time.monotonic() + 150
            job = created.json()
            while job["status"] not in ("completed", "failed", "expired", "cancelled"):
                assert time.monotonic() < deadline, f"still {job['status']}: {child.tail()}"
                time.sleep(0.5)
                job = http.get(f"/v1/batches/{batch_id}").json()  # from either worker
            assert job["status"] == "completed", job
            output = http.get(f"/v1/files/{job['output_file_id']}/content").text
            box = budget_by_worker(http.get("/metrics").text)  # one scrape, the whole box
            own = budget_by_worker(http.get("/metrics", params={"scope": "worker"}).text)
            turn = http.get("/turn").json()  # one worker's answer, for the box
            own_turn = http.get("/turn", params={"scope": "worker"}).json()
            text = http.get("/turn", params={"format": "text"}).text
    answered = [json.loads(line)["custom_id"] for line in output.splitlines()]
    assert sorted(answered) == sorted(ids), "a line missing, or answered twice"
    assert job["request_counts"]["completed"] == n and job["request_counts"]["failed"] == 0
    with sqlite3.connect(data / "batch.sqlite3") as db:
        runners = db.execute(
            "SELECT claimed_by, COUNT(*) FROM lines WHERE batch_id = ? GROUP BY claimed_by",
            (batch_id,),
        ).fetchall()
    assert len(runners) == 2, f"one runner ran every line: {runners}"
    assert set(box) == {"w0", "w1"}, box
    assert list(own) == [None], "a worker asked for its own answers for itself alone"
    assert set(turn["box"]["workers"]) == {"w0", "w1"} and turn["box"]["missing"] == []
    for name, worker in turn["box"]["workers"].items():
        assert worker["replica"] == f"t-{name}"
        assert [e["engine"] for e in worker["engines"]] == ["e0"], worker
    assert "box" not in own_turn
    # as text, whichever worker answers: its own engines, then the other worker's, named
    assert ("[w0] " in text) != ("[w1] " in text), text
