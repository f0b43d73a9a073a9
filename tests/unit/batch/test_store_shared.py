"""The SQLite batch store shared by the worker processes of one box (each a store
of its own on the one file, as each worker opens it): a line is leased to one
runner at a time however many claim at once, a job is filled once, both finalize
at once and get the same files, and the leases live in the file: a store that
shares it keeps them when it opens, the file's only user drops them (a restart's
lines run again at once), as :func:`~proxy.batch.sqlite.prepare` does before the
workers start."""

from __future__ import annotations

import io
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from proxy.batch.lines import read_lines
from proxy.batch.sqlite import SQLiteStore, prepare
from proxy.batch.store import BatchRecord, LineResult, NewBatch
from tests.unit.batch.test_store import CHAT, jsonl

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def shared(path: Path, n: int) -> list[SQLiteStore]:
    stores = [SQLiteStore(path, lambda: 1000.0, exclusive=False) for _ in range(n)]
    for store in stores:
        await store.open()
    return stores


async def claim_from_both(stores: list[SQLiteStore], batch_id: str) -> dict[str, list[int]]:
    """Three claimers on each store take the job's 300 lines, 7 at a time."""
    await stores[0].add_batch(NewBatch(batch_id, CHAT, "file-x", "24h", 86400, None))
    await stores[0].fill_batch(batch_id, read_lines(io.BytesIO(jsonl(300)), CHAT, 1000))
    got: dict[str, list[int]] = {"w0": [], "w1": []}

    async def take(store: SQLiteStore, owner: str) -> None:
        while page := await store.claim(batch_id, owner, 7, 30):
            got[owner].extend(p.idx for p in page)
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as group:
        for i, store in enumerate(stores):
            for _ in range(3):
                group.start_soon(take, store, f"w{i}")
    return got


async def test_workers_never_claim_one_line_twice(tmp_path: Path) -> None:
    stores = await shared(tmp_path / "b.db", 2)
    # the evidence is two stores claiming at once: a run where one store's claimers
    # took every line before the other's began (a loaded machine) is run again
    for attempt in range(1, 6):
        got = await claim_from_both(stores, f"batch_{attempt}")
        assert sorted(got["w0"] + got["w1"]) == list(range(1, 301))
        if got["w0"] and got["w1"]:
            break
    else:
        pytest.fail("in 5 tries one store always claimed every line: no contention seen")
    batch = f"batch_{attempt}"
    for idx in range(1, 301):
        assert await stores[idx % 2].record(batch, idx, LineResult(True, "{}"))
    finals: list[BatchRecord] = []

    async def finalize(store: SQLiteStore) -> None:
        finals.append(await store.finalize(batch, "completed"))

    async with anyio.create_task_group() as group:  # both finalize at once
        for store in stores:
            group.start_soon(finalize, store)
    assert {(r.status, r.output_file_id, r.completed) for r in finals} == {
        ("completed", f"file-{batch}-output", 300)
    }
    assert (stores[1].files_dir / f"file-{batch}-output").read_text().count("\n") == 300
    assert not list(stores[0].files_dir.glob("*.tmp")), "a temporary file was left"
    for store in stores:
        await store.close()


async def test_a_job_is_filled_once_however_many_workers_try(tmp_path: Path) -> None:
    a, b = await shared(tmp_path / "b.db", 2)
    await a.add_batch(NewBatch("batch_1", CHAT, "file-x", "24h", 86400, None))
    await a.fill_batch("batch_1", read_lines(io.BytesIO(jsonl(3)), CHAT, 1000))
    (line, *_) = await a.claim("batch_1", "w0", 1, 30)
    assert await a.record("batch_1", line.idx, LineResult(True, "{}"))
    # b read the job while it was validating; its fill comes late and changes nothing
    again = await b.fill_batch("batch_1", read_lines(io.BytesIO(jsonl(3)), CHAT, 1000))
    assert (again.status, again.total, again.completed) == ("in_progress", 3, 1)
    assert [p.idx for p in await b.claim("batch_1", "w1", 10, 30)] == [2, 3]
    await a.close()
    await b.close()


async def test_leases_live_in_the_file_and_only_its_only_user_drops_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "b.db"
    (a,) = await shared(path, 1)
    await a.add_batch(NewBatch("batch_1", CHAT, "file-x", "24h", 86400, None))
    await a.fill_batch("batch_1", read_lines(io.BytesIO(jsonl(4)), CHAT, 1000))
    assert len(await a.claim("batch_1", "w0", 2, 30)) == 2
    await a.close()  # the worker dies with its lines leased
    (other,) = await shared(path, 1)
    assert [p.idx for p in await other.claim("batch_1", "w1", 10, 30)] == [3, 4]
    await other.close()
    prepare(path)  # the next start of the box: its parent drops every lease
    (after,) = await shared(path, 1)
    assert [p.idx for p in await after.claim("batch_1", "w2", 10, 30)] == [1, 2, 3, 4]
    await after.close()
    alone = SQLiteStore(path, lambda: 1000.0)  # the file's only user drops them too
    await alone.open()
    assert [p.idx for p in await alone.claim("batch_1", "x", 10, 30)] == [1, 2, 3, 4]
    await alone.close()
