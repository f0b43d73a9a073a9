"""The runner over a real SQLite store, with the request path replaced by a
function that answers as an engine would: retries, the window, the files."""

from __future__ import annotations

import io
import json
from collections import Counter as Tally
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

from proxy.batch.lines import read_lines
from proxy.batch.runner import BatchRunner, RunnerLimits
from proxy.batch.sqlite import SQLiteStore
from proxy.batch.store import NewBatch
from proxy.metrics import BatchMetrics
from proxy.openai.answers import Answer
from proxy.openai.line_ids import job_id, job_line
from proxy.openai.request import ChatRequest

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
OK = {"object": "chat.completion", "choices": [{"message": {"content": "{}"}}]}


def jsonl(n: int) -> bytes:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": body} for i in range(n)]
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


class Engine:
    """Answers each line's tries from a script: ``fails[custom_id]`` 5xx first."""

    def __init__(self, fails: dict[str, int]) -> None:
        self.fails = fails
        self.tries: Tally[str] = Tally()
        self.inflight = 0
        self.most_inflight = 0

    async def complete(self, req: ChatRequest, job_id: str) -> Answer:
        custom_id = job_id.split("/")[1]
        self.tries[custom_id] += 1
        self.inflight += 1
        self.most_inflight = max(self.most_inflight, self.inflight)
        await anyio.sleep(0.001)
        self.inflight -= 1
        if self.tries[custom_id] <= self.fails.get(custom_id, 0):
            return Answer.of(503, {"error": {"message": "busy"}})
        return Answer.of(200, OK)


async def run_job(
    tmp_path: Path, engine: Engine, lines: int, window: int, known: Any = lambda: True
) -> SQLiteStore:
    store = SQLiteStore(tmp_path / "b.db", lambda: 0.0)
    await store.open()
    await store.add_batch(NewBatch("batch_1", CHAT, "file-x", "24h", 86400, None))
    await store.fill_batch("batch_1", read_lines(io.BytesIO(jsonl(lines)), CHAT, 10_000))
    limits = RunnerLimits(window=window, max_attempts=3, backoff_s=0.001, poll_s=0.01)
    metrics = BatchMetrics()
    runner = BatchRunner(store, engine.complete, metrics, limits, lambda: 0, known)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(runner.run)
            while True:
                batch = await store.get_batch("batch_1")
                if batch is not None and batch.status == "completed":
                    break
                await anyio.sleep(0.01)
            group.cancel_scope.cancel()
    return store


async def test_engine_errors_are_retried_then_recorded(tmp_path: Path) -> None:
    engine = Engine({"c1": 2, "c2": 5})
    store = await run_job(tmp_path, engine, 4, window=2)
    batch = await store.get_batch("batch_1")
    assert batch is not None and (batch.completed, batch.failed) == (3, 1)
    assert engine.tries == {"c0": 1, "c1": 3, "c2": 3, "c3": 1}
    assert batch.error_file_id is not None
    errors = store.file_path(batch.error_file_id).read_text().splitlines()
    assert [json.loads(x)["response"]["status_code"] for x in errors] == [503]
    await store.close()


async def test_the_window_bounds_the_lines_in_flight(tmp_path: Path) -> None:
    engine = Engine({})
    store = await run_job(tmp_path, engine, 200, window=8)
    assert engine.most_inflight <= 8
    assert sum(engine.tries.values()) == 200
    batch = await store.get_batch("batch_1")
    assert batch is not None and batch.output_file_id is not None
    out = store.file_path(batch.output_file_id).read_text().splitlines()
    assert [json.loads(x)["custom_id"] for x in out] == [f"c{i}" for i in range(200)]
    await store.close()


async def test_no_line_is_fed_before_the_engines_models_are_known(tmp_path: Path) -> None:
    engine = Engine({})
    asked: list[int] = []

    def known() -> bool:
        asked.append(len(engine.tries))
        return len(asked) > 5

    store = await run_job(tmp_path, engine, 3, window=2, known=known)
    assert asked[:5] == [0] * 5
    assert sum(engine.tries.values()) == 3
    await store.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def drive_until(
    store: SQLiteStore, runner: BatchRunner, batch_id: str, status: str, step: Any = None
) -> None:
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(runner.run)
            while True:
                batch = await store.get_batch(batch_id)
                if batch is not None and batch.status == status:
                    break
                if step is not None:
                    await step(batch)
                await anyio.sleep(0.01)
            group.cancel_scope.cancel()


def bare_runner(store: SQLiteStore, complete: Any, clock: Any = lambda: 0.0) -> BatchRunner:
    limits = RunnerLimits(window=4, max_attempts=1, backoff_s=0.001, poll_s=0.01, max_lines=5)
    return BatchRunner(store, complete, BatchMetrics(), limits, clock)


async def upload(store: SQLiteStore, tmp_path: Path, data: bytes) -> str:
    source = tmp_path / "upload"
    source.write_bytes(data)
    return (await store.add_file("batch", "in.jsonl", source)).id


async def test_a_job_is_validated_as_its_first_step(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "b.db", lambda: 0.0)
    await store.open()
    file_id = await upload(store, tmp_path, jsonl(3))
    added = await store.add_batch(NewBatch("batch_ok", CHAT, file_id, "24h", 86400, None))
    assert added.status == "validating"
    await drive_until(store, bare_runner(store, Engine({}).complete), "batch_ok", "completed")
    done = await store.get_batch("batch_ok")
    assert done is not None and (done.total, done.completed) == (3, 3)
    assert done.times["in_progress_at"] == 0 and done.errors is None
    await store.close()


@pytest.mark.parametrize(
    ("data", "line", "message"),
    [
        (jsonl(2) + b"[1]\n", 3, "Line 3: expected a JSON object"),
        (jsonl(6), 6, "more than the limit of 5 requests"),
        (b"\n", None, "no requests"),
    ],
)
async def test_a_bad_input_file_fails_the_job_with_openais_errors(
    tmp_path: Path, data: bytes, line: int | None, message: str
) -> None:
    store = SQLiteStore(tmp_path / "b.db", lambda: 0.0)
    await store.open()
    engine = Engine({})
    file_id = await upload(store, tmp_path, data)
    await store.add_batch(NewBatch("batch_bad", CHAT, file_id, "24h", 86400, None))
    await drive_until(store, bare_runner(store, engine.complete), "batch_bad", "failed")
    failed = await store.get_batch("batch_bad")
    assert failed is not None and failed.errors is not None and not engine.tries
    [error] = failed.errors
    assert error["line"] == line and message in error["message"]
    assert failed.output_file_id is None and failed.times["failed_at"] == 0
    await store.close()


async def test_expiry_writes_an_error_line_for_each_unfinished_line(tmp_path: Path) -> None:
    """Two lines answer; the others hang until the injected clock passes the window."""
    clock = Clock()
    store = SQLiteStore(tmp_path / "b.db", clock)
    await store.open()
    file_id = await upload(store, tmp_path, jsonl(5))
    await store.add_batch(NewBatch("batch_exp", CHAT, file_id, "1h", 3600, None))

    async def complete(req: ChatRequest, job_id: str) -> Answer:
        if job_id.split("/")[1] in ("c0", "c1"):
            return Answer.of(200, OK)
        await anyio.sleep_forever()
        raise AssertionError

    async def step(batch: Any) -> None:
        if batch is not None and batch.completed == 2:
            clock.now = 3600.0

    await drive_until(store, bare_runner(store, complete, clock), "batch_exp", "expired", step)
    done = await store.get_batch("batch_exp")
    assert done is not None and (done.completed, done.failed, done.total) == (2, 3, 5)
    assert done.times["expired_at"] == 3600 and done.error_file_id is not None
    errors = [json.loads(x) for x in store.file_path(done.error_file_id).read_text().splitlines()]
    assert [x["custom_id"] for x in errors] == ["c2", "c3", "c4"]
    assert {x["error"]["code"] for x in errors} == {"batch_expired"}
    assert all(x["response"] is None for x in errors)
    assert done.output_file_id is not None
    assert len(store.file_path(done.output_file_id).read_text().splitlines()) == 2
    await store.close()


@pytest.mark.parametrize(
    ("job", "expected"),
    [
        (job_id("batch_1", "c0", 1), ("batch_1", "c0", 1)),
        (job_id("batch_1", "a/b/3", 2), ("batch_1", "a/b/3", 2)),  # a custom_id with slashes
        ("chatcmpl-123", None),
        ("batch_1/c0/x", None),
        ("other/c0/1", None),
    ],
)
def test_the_decision_log_reads_a_lines_job_and_custom_id_back(
    job: str, expected: tuple[str, str, int] | None
) -> None:
    assert job_line(job) == expected


@pytest.mark.integration
async def test_two_runners_on_postgres_share_a_job_and_run_each_line_once(
    postgres_db: str,
) -> None:
    from proxy.batch.postgres import PostgresStore

    engine = Engine({})
    stores = [PostgresStore(postgres_db, lambda: 0.0, pool_size=4) for _ in range(2)]
    for s in stores:
        await s.open()
    await stores[0].add_batch(NewBatch("batch_1", CHAT, "file-x", "24h", 86400, None))
    await stores[0].fill_batch("batch_1", read_lines(io.BytesIO(jsonl(300)), CHAT, 10_000))
    limits = RunnerLimits(window=4, max_attempts=3, backoff_s=0.001, poll_s=0.01, lease_s=5)
    runners = [
        BatchRunner(s, engine.complete, BatchMetrics(), limits,
                    lambda: 0, owner=f"replica-{i}")
        for i, s in enumerate(stores)
    ]  # fmt: skip
    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            for runner in runners:
                group.start_soon(runner.run)
            while True:
                batch = await stores[0].get_batch("batch_1")
                if batch is not None and batch.status == "completed":
                    break
                await anyio.sleep(0.02)
            group.cancel_scope.cancel()
    assert engine.tries == {f"c{i}": 1 for i in range(300)}
    assert (batch.completed, batch.failed, batch.total) == (300, 0, 300)
    out = b"".join([c async for c in stores[1].read_file(str(batch.output_file_id))])
    assert [json.loads(x)["custom_id"] for x in out.splitlines()] == [f"c{i}" for i in range(300)]
    with psycopg.connect(postgres_db) as conn:
        owners = conn.execute("SELECT DISTINCT claimed_by FROM lines").fetchall()
    assert {o for (o,) in owners} == {"replica-0", "replica-1"}  # both did some
    for s in stores:
        await s.close()
