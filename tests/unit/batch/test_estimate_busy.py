"""The estimate through the runner, on an injected clock that moves only when the
engine answers (a line takes one second) or the test says so: time with no line in
flight does not slow the estimate, and the estimate survives a restart (the pace
stored with the job, on SQLite and on PostgreSQL) on the batch object and the
metrics."""

from __future__ import annotations

import io
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from proxy.batch.lines import read_lines
from proxy.batch.postgres import PostgresStore
from proxy.batch.runner import BatchRunner, RunnerLimits
from proxy.batch.shapes import batch_object
from proxy.batch.sqlite import SQLiteStore
from proxy.batch.store import BatchRecord, BatchStore, NewBatch, Progress
from proxy.batch.view import deadlines
from proxy.metrics import BatchMetrics, Deadline
from proxy.openai.answers import Answer
from proxy.openai.request import ChatRequest
from tests.unit.batch.test_runner import CHAT, OK, jsonl, upload

pytestmark = pytest.mark.anyio
START = 1000.0
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.integration)]


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


class Engine:
    """Answers a line in one second of ``clock``; a line named in ``hang``
    (``<batch>/<custom_id>``) stays in flight, and ``hanging`` says it started."""

    def __init__(self, clock: Clock, hang: set[str]) -> None:
        self.clock = clock
        self.hang = hang
        self.hanging = anyio.Event()

    async def complete(self, req: ChatRequest, job_id: str) -> Answer:
        if job_id.rsplit("/", 1)[0] in self.hang:
            self.hanging.set()
            await anyio.sleep_forever()
        self.clock.now += 1.0
        return Answer.of(200, OK)


def new_runner(store: BatchStore, engine: Engine, clock: Clock) -> BatchRunner:
    """One line at a time: a job of n lines is busy n seconds."""
    limits = RunnerLimits(window=1, max_attempts=1, poll_s=0.01, progress_s=5.0)
    return BatchRunner(store, engine.complete, BatchMetrics(), limits, clock)


async def new_job(store: BatchStore, batch_id: str, lines: int) -> None:
    await store.add_batch(NewBatch(batch_id, CHAT, "file-x", "24h", 86400, None))
    await store.fill_batch(batch_id, read_lines(io.BytesIO(jsonl(lines)), CHAT, 1000))


async def until(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll a state of the store and the runner (no event is sent for it)."""
    while True:
        if await check():
            return
        await anyio.sleep(0.01)


async def found(store: BatchStore, batch_id: str) -> BatchRecord:
    batch = await store.get_batch(batch_id)
    assert batch is not None
    return batch


async def test_time_a_job_waits_with_no_line_in_flight_does_not_slow_its_estimate(
    tmp_path: Path,
) -> None:
    """Ten lines in 10 s, then 100 s with none in flight (another runner holds the
    rest), then the next line in flight: 1 line/s, 10 left, done 10 s from now;
    a rate over the 110 s since the job began said 110 s."""
    clock = Clock()
    store = SQLiteStore(tmp_path / "b.db", clock)
    await store.open()
    await new_job(store, "batch_1", 20)
    assert len(await store.claim("batch_1", "first", 10, 3600)) == 10  # c0..c9
    assert len(await store.claim("batch_1", "other", 10, 3600)) == 10  # c10..c19
    await store.release("batch_1", "first")
    engine = Engine(clock, {"batch_1/c10"})
    runner = new_runner(store, engine, clock)

    async def idle() -> bool:
        done = (await found(store, "batch_1")).completed == 10
        return done and runner.throughput.in_flight("batch_1") == 0

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(runner.run)
            await until(idle)
            clock.now += 100.0  # nothing in flight: the runner polls for lines
            await store.release("batch_1", "other")
            await engine.hanging.wait()  # c10 in flight at 1110
            estimate = runner.estimate(await found(store, "batch_1"))
            group.cancel_scope.cancel()
    assert clock.now == START + 110
    assert estimate is not None and estimate.estimated_completion_at == START + 120
    assert estimate.records_per_hour == 3600.0
    assert estimate.basis == "measured over 10 lines in 10 s busy"
    await store.close()


async def test_a_models_rate_does_not_count_the_time_between_its_jobs(
    tmp_path: Path,
) -> None:
    """Job a does 10 lines in 10 s and ends; 200 s later job b starts on the same
    model: its estimate is the model's 1 line/s, not 10 lines over 210 s."""
    clock = Clock()
    store = SQLiteStore(tmp_path / "b.db", clock)
    await store.open()
    await new_job(store, "batch_a", 10)
    engine = Engine(clock, {"batch_b/c0"})
    runner = new_runner(store, engine, clock)

    async def a_done() -> bool:
        return (await found(store, "batch_a")).status == "completed"

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(runner.run)
            await until(a_done)
            clock.now += 200.0
            # as the API submits a job while a runner polls: the runner reads the input
            # file in itself (filling it here too raced the runner's own validation,
            # which found no file and failed the job)
            file_id = await upload(store, tmp_path, jsonl(20))
            await store.add_batch(NewBatch("batch_b", CHAT, file_id, "24h", 86400, None))
            await engine.hanging.wait()  # b's first line in flight at 1210
            estimate = runner.estimate(await found(store, "batch_b"))
            group.cancel_scope.cancel()
    assert estimate is not None and estimate.estimated_completion_at == START + 230
    assert estimate.records_per_hour == 3600.0
    assert estimate.basis == "model tiny's rate, 10 lines in 10 s busy"
    await store.close()


async def open_store(kind: str, where: str, clock: Clock) -> BatchStore:
    store: BatchStore
    if kind == "sqlite":
        store = SQLiteStore(Path(where), clock)
    else:
        store = PostgresStore(where, clock, pool_size=4)
    await store.open()
    return store


@pytest.mark.parametrize("kind", BACKENDS)
async def test_the_estimate_survives_a_restart(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A runner records 10 lines in 10 s; its 11th line is in flight 5 s more (the
    pace is saved while it runs), then the process stops. An hour later a new one
    on the same store estimates at once from the stored pace: 10 lines in 15 s
    busy, 10 left, 15 s. Before, the estimate was null until new lines were
    measured."""
    where = str(tmp_path / "b.db")
    if kind == "postgres":
        where = request.getfixturevalue("postgres_db")
    clock = Clock()
    store = await open_store(kind, where, clock)
    await new_job(store, "batch_1", 20)
    engine = Engine(clock, {"batch_1/c10"})
    runner = new_runner(store, engine, clock)

    async def saved() -> bool:
        return (await found(store, "batch_1")).progress == Progress(15.0, 10, 10)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as group:
            group.start_soon(runner.run)
            await engine.hanging.wait()
            clock.now += 5.0  # c10 still in flight: busy, and progress_s has passed
            await until(saved)  # saved while running: a crash now keeps it
            group.cancel_scope.cancel()
    await store.close()

    clock.now += 3600.0  # down for an hour
    store = await open_store(kind, where, clock)
    after = new_runner(store, Engine(clock, {"batch_1/c10"}), clock)
    batch = await found(store, "batch_1")
    estimate = after.estimate(batch)
    now = START + 15 + 3600
    assert estimate is not None and estimate.estimated_completion_at == now + 15
    assert (estimate.records_per_hour, estimate.valid_records_per_hour) == (2400.0, 2400.0)
    assert estimate.basis == "after restart, from the stored rate: 10 lines in 15 s busy"
    assert batch_object(batch, estimate)["whoseturn"] == estimate.body()

    async def running() -> bool:
        return bool(after.active) and after.throughput.in_flight("batch_1") == 1

    with anyio.fail_after(20):
        async with anyio.create_task_group() as group:
            group.start_soon(after.run)
            await until(running)
            assert list(deadlines(after)) == [Deadline("batch_1", START + 86400, now + 15)]
            group.cancel_scope.cancel()
    await store.close()
