"""The runner outlives its store's errors: a store that raises once in each method
the runner calls (an outage, through :class:`~proxy.batch.health.GuardedStore` as
the proxy builds it, or an error the store does not call an outage) still sees
every job complete, each line run once, and the runner polling on; and the proxy's
shutdown closes everything even when a loop of its own has died."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections import Counter as Tally
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from proxy.batch.health import GuardedStore, StoreDown
from proxy.batch.runner import BatchRunner, RunnerLimits
from proxy.batch.sqlite import SQLiteStore
from proxy.batch.store import NewBatch
from proxy.clock import WallClock
from proxy.config import EngineConfig, Settings
from proxy.metrics import BatchMetrics
from proxy.openai.answers import Answer
from proxy.openai.request import ChatRequest
from proxy.server import build, shutdown
from tests.unit.batch.test_runner import CHAT, OK, jsonl

pytestmark = pytest.mark.anyio

# Every store method the runner calls, on a job's way from validating to completed.
RUNNER_CALLS = (
    "active_batches", "count_by_status", "get_batch", "local_file", "fill_batch",
    "claim", "renew", "release", "record", "add_progress", "set_status", "finalize",
)  # fmt: skip


class FlakyStore(SQLiteStore):
    """SQLite, except that the first call of each method in ``RUNNER_CALLS`` raises
    ``error`` (before touching the database); every call is counted."""

    def __init__(self, path: Path, error: Callable[[str], Exception]) -> None:
        super().__init__(path, time.time)
        self.error = error
        self.calls: Tally[str] = Tally()
        self.raised: set[str] = set()
        self.armed = False

    def _trip(self, name: str) -> None:
        self.calls[name] += 1
        if self.armed and name not in self.raised:
            self.raised.add(name)
            raise self.error(name)

    def __getattribute__(self, name: str) -> Any:
        found = super().__getattribute__(name)
        if name not in RUNNER_CALLS:
            return found
        trip = super().__getattribute__("_trip")
        if name == "local_file":

            def opened(*args: Any) -> Any:
                trip(name)
                return found(*args)

            return opened

        async def call(*args: Any) -> Any:
            trip(name)
            return await found(*args)

        return call


class Engine:
    def __init__(self) -> None:
        self.tries: Tally[str] = Tally()

    async def complete(self, req: ChatRequest, job_id: str) -> Answer:
        self.tries[job_id.split("/")[1]] += 1
        await anyio.sleep(0.05)  # long enough that leases are renewed while lines run
        return Answer.of(200, OK)


def outage(name: str) -> Exception:
    return sqlite3.OperationalError(f"disk I/O error in {name}")


def fault(name: str) -> Exception:
    return RuntimeError(f"unexpected trouble in {name}")


async def run_two_jobs(
    tmp_path: Path, error: Callable[[str], Exception]
) -> tuple[FlakyStore, GuardedStore, Engine]:
    """Two 30-line jobs through a runner over a store whose every method raises
    ``error`` once; returns once both are completed and the runner polled on."""
    flaky = FlakyStore(tmp_path / "b.db", error)
    store = GuardedStore(
        flaky, time.monotonic, timeout_s=None, outage_errors=(sqlite3.OperationalError,),
        probe_s=0.02,
    )  # fmt: skip
    await store.open()
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl(30))
    file_id = (await store.add_file("batch", "in.jsonl", source)).id
    for job in JOBS:
        await store.add_batch(NewBatch(job, CHAT, file_id, "24h", 86400, None))
    flaky.armed = True
    limits = RunnerLimits(window=4, max_attempts=1, backoff_s=0.001, poll_s=0.01, lease_s=0.3)
    engine = Engine()
    runner = BatchRunner(store, engine.complete, BatchMetrics(), limits, time.time)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(store.watch)
            group.start_soon(runner.run)
            while True:
                found = [await SQLiteStore.get_batch(flaky, job) for job in JOBS]
                if all(b is not None and b.status == "completed" for b in found):
                    break
                await anyio.sleep(0.02)
            polls = flaky.calls["active_batches"]
            await anyio.sleep(0.2)
            assert flaky.calls["active_batches"] > polls + 3  # the runner polls on
            group.cancel_scope.cancel()
    return flaky, store, engine


JOBS = ("batch_a", "batch_b")


@pytest.mark.parametrize("error", [outage, fault], ids=["outage", "other-error"])
async def test_a_store_raising_once_in_each_method_still_completes_every_job(
    tmp_path: Path, error: Callable[[str], Exception]
) -> None:
    # the evidence is every method having raised once on the way; a run where the
    # jobs ended before some method was called at all (a loaded machine: seen for
    # add_progress) is run again on a fresh store
    for attempt in range(3):
        (tmp_path / f"try-{attempt}").mkdir()
        flaky, store, engine = await run_two_jobs(tmp_path / f"try-{attempt}", error)
        for job in JOBS:  # whatever was raised, every line done once
            batch = await SQLiteStore.get_batch(flaky, job)
            assert batch is not None and (batch.completed, batch.failed) == (30, 0)
            assert batch.output_file_id is not None
            out = flaky.file_path(batch.output_file_id).read_text().splitlines()
            assert sorted(json.loads(x)["custom_id"] for x in out) == sorted(
                f"c{i}" for i in range(30)
            )
        # Each line reached the engine once per job: a record that failed was tried
        # again with the answer in hand, not by running the line again.
        assert engine.tries == {f"c{i}": 2 for i in range(30)}
        if error is outage:
            assert store.health.outages >= 1 and store.health.up
        await store.close()
        missing = set(RUNNER_CALLS) - flaky.raised
        if not missing:
            break
        assert all(flaky.calls[name] == 0 for name in missing), "called but never raised"
    else:
        pytest.fail(f"in 3 runs these were never called, so never raised: {sorted(missing)}")
    assert flaky.raised == set(RUNNER_CALLS)  # each method did raise once


async def test_shutdown_closes_everything_after_a_loop_died(tmp_path: Path) -> None:
    """A loop of the proxy's that ended with an error is logged at shutdown, and the
    store and the HTTP client are closed all the same."""

    def engine(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny"}]})

    settings = Settings.from_keys(
        engines=(EngineConfig(url="http://engine-a:8000", name="a", models=("tiny",)),),
        batch_store_path=str(tmp_path / "b.db"),
    )
    state = await build(settings, httpx.MockTransport(engine), WallClock())
    assert state.batch is not None
    await state.batch.store.ping()

    async def dies() -> None:
        raise RuntimeError("a loop that died")

    state.tasks.append(asyncio.create_task(dies(), name="whoseturn-test-loop"))
    await asyncio.sleep(0)
    await shutdown(state)  # does not raise the dead loop's error
    assert state.http.is_closed
    with pytest.raises(StoreDown, match="not open"):
        await state.batch.store.ping()
