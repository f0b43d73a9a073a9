"""The batch store's contract, on both backends (a SQLite file; a real PostgreSQL
database per test): what the runner's exactly once and the shared queue rest on."""

from __future__ import annotations

import io
import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import psycopg
import pytest

from proxy.batch.lines import answered, quality, read_lines
from proxy.batch.postgres import MIGRATIONS, PostgresStore
from proxy.batch.sqlite import SQLiteStore
from proxy.batch.store import BatchStore, LineError, LineResult, NewBatch
from proxy.openai.answers import Answer

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
SCHEMA = {"type": "json_schema", "json_schema": {"schema": {"required": ["a"]}}}
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.integration)]
PROGRESS_COLUMNS = ("busy_s", "busy_records", "busy_usable")  # schema 4
LEASE_COLUMNS = ("claimed_by", "lease_until")  # schema 5: the leases in the file


def jsonl(n: int) -> bytes:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": body} for i in range(n)]
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BatchStore]:
    s: BatchStore
    if request.param == "sqlite":
        s = SQLiteStore(tmp_path / "b.db", lambda: 1000.0)
    else:
        s = PostgresStore(request.getfixturevalue("postgres_db"), lambda: 1000.0, pool_size=4)
    await s.open()
    yield s
    await s.close()


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    s = SQLiteStore(tmp_path / "b.db", lambda: 1000.0)
    await s.open()
    yield s
    await s.close()


async def new_job(store: BatchStore, n: int, batch_id: str = "batch_1") -> None:
    await store.add_batch(NewBatch(batch_id, CHAT, "file-x", "24h", 86400, None))
    await store.fill_batch(batch_id, read_lines(io.BytesIO(jsonl(n)), CHAT, 1000))


async def content(store: BatchStore, file_id: str | None) -> str:
    assert file_id is not None
    return b"".join([chunk async for chunk in store.read_file(file_id)]).decode()


async def test_sqlite_schema_is_versioned_and_wal(sqlite_store: SQLiteStore) -> None:
    with sqlite3.connect(sqlite_store.path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 5
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_a_version_1_store_is_migrated_and_keeps_its_jobs(tmp_path: Path) -> None:
    old = SQLiteStore(tmp_path / "b.db", lambda: 1000.0)
    await old.open()
    await new_job(old, 2)
    await old.close()
    with sqlite3.connect(tmp_path / "b.db") as db:  # back to schema 1: no `errors`, `tenant`
        for column in ("errors", "tenant", *PROGRESS_COLUMNS):
            db.execute(f"ALTER TABLE batches DROP COLUMN {column}")
        for column in LEASE_COLUMNS:  # schema 5's
            db.execute(f"ALTER TABLE lines DROP COLUMN {column}")
        db.execute("PRAGMA user_version = 1")
    store = SQLiteStore(tmp_path / "b.db", lambda: 1000.0)
    await store.open()
    batch = await store.get_batch("batch_1")
    assert batch is not None and (batch.total, batch.errors) == (2, None)
    failed = await store.fail_batch("batch_1", [{"code": "x", "message": "m"}])
    assert failed.errors == [{"code": "x", "message": "m"}]
    await store.close()


@pytest.mark.integration
async def test_a_version_1_postgres_store_is_migrated_and_keeps_its_jobs(
    postgres_db: str,
) -> None:
    old = PostgresStore(postgres_db, lambda: 1000.0, pool_size=2)
    await old.open()
    await new_job(old, 2)
    await old.close()
    with psycopg.connect(postgres_db, autocommit=True) as conn:  # back to schema 1
        for column in ("errors", "tenant", *PROGRESS_COLUMNS):
            conn.execute(f"ALTER TABLE batches DROP COLUMN {column}")
        conn.execute("UPDATE schema_version SET version = 1")
    store = PostgresStore(postgres_db, lambda: 1000.0, pool_size=2)
    await store.open()
    assert await store.schema_version() == len(MIGRATIONS) == 4
    batch = await store.get_batch("batch_1")
    assert batch is not None and (batch.total, batch.errors) == (2, None)
    failed = await store.fail_batch("batch_1", [{"code": "x", "message": "m"}])
    assert failed.errors == [{"code": "x", "message": "m"}]
    await store.close()


async def test_an_unknown_sqlite_schema_version_stops_the_store(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "b.db") as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(RuntimeError, match="schema 99"):
        await SQLiteStore(tmp_path / "b.db", lambda: 0.0).open()


async def test_a_line_is_recorded_once(store: BatchStore) -> None:
    await new_job(store, 3)
    result = answered("c1", Answer.of(200, {"choices": []}), {})
    assert await store.record("batch_1", 2, result)
    assert not await store.record("batch_1", 2, LineResult(False, "{}"))
    batch = await store.get_batch("batch_1")
    assert batch is not None and (batch.total, batch.completed, batch.failed) == (3, 1, 0)
    assert [p.idx for p in await store.claim("batch_1", "a", 10, 30)] == [1, 3]


async def test_records_at_once_are_each_stored_once(store: BatchStore) -> None:
    """64 lines recorded at once, each twice (an ok and a failed result): each line is
    stored once, the first of its two calls says so, the counts add up."""
    await new_job(store, 64)
    said: dict[tuple[int, bool], bool] = {}

    async def put(idx: int, ok: bool) -> None:
        said[(idx, ok)] = await store.record("batch_1", idx, LineResult(ok, f"{idx}"))

    async with anyio.create_task_group() as group:
        for idx in range(1, 65):
            group.start_soon(put, idx, idx % 3 != 0)
            group.start_soon(put, idx, idx % 3 == 0)
    assert all(said[(i, True)] != said[(i, False)] for i in range(1, 65))
    batch = await store.get_batch("batch_1")
    assert batch is not None
    stored_ok = sum(said[(i, True)] for i in range(1, 65))
    assert (batch.completed, batch.failed) == (stored_ok, 64 - stored_ok)
    assert await store.claim("batch_1", "a", 100, 30) == []


async def test_a_repeated_custom_id_stores_no_lines(store: BatchStore) -> None:
    await store.add_batch(NewBatch("batch_2", CHAT, "file-x", "24h", 86400, None))
    bad = jsonl(2) + b"\n" + jsonl(1)  # c0 again on line 4 (after a blank one)
    with pytest.raises(LineError, match="Line 4: duplicate custom_id `c0`"):
        await store.fill_batch("batch_2", read_lines(io.BytesIO(bad), CHAT, 1000))
    still = await store.get_batch("batch_2")
    assert still is not None and (still.status, still.total) == ("validating", 0)
    assert await store.claim("batch_2", "a", 10, 30) == []


async def test_a_job_is_validating_until_its_lines_are_stored(store: BatchStore) -> None:
    added = await store.add_batch(NewBatch("batch_3", CHAT, "file-x", "24h", 86400, None))
    assert (added.status, added.total, added.expires_at) == ("validating", 0, 1000 + 86400)
    assert "in_progress_at" not in added.times
    bad = jsonl(2) + b"{not json\n"
    with pytest.raises(LineError, match="Line 3"):
        await store.fill_batch("batch_3", read_lines(io.BytesIO(bad), CHAT, 1000))
    still = await store.get_batch("batch_3")
    assert still is not None and (still.status, still.total) == ("validating", 0)
    assert await store.claim("batch_3", "a", 10, 30) == []
    filled = await store.fill_batch("batch_3", read_lines(io.BytesIO(jsonl(4)), CHAT, 1000))
    assert (filled.status, filled.total, filled.times["in_progress_at"]) == ("in_progress", 4, 1000)
    assert [p.idx for p in await store.claim("batch_3", "a", 10, 30)] == [1, 2, 3, 4]


async def test_expiry_records_an_error_line_for_each_line_left(store: BatchStore) -> None:
    await new_job(store, 3)
    await store.record("batch_1", 2, LineResult(True, '{"custom_id": "c1"}'))
    assert await store.expire_pending("batch_1", lambda c: LineResult(False, c)) == 2
    assert await store.claim("batch_1", "a", 10, 30) == []
    done = await store.finalize("batch_1", "expired")
    assert (done.completed, done.failed, done.status) == (1, 2, "expired")
    assert done.error_file_id is not None and done.times["expired_at"] == 1000
    assert await content(store, done.error_file_id) == "c0\nc2\n"


async def test_finalize_twice_writes_the_same_files(store: BatchStore) -> None:
    await new_job(store, 2)
    await store.record("batch_1", 1, LineResult(True, '{"custom_id": "c0"}'))
    await store.record("batch_1", 2, LineResult(False, '{"custom_id": "c1"}'))
    first = await store.finalize("batch_1", "completed")
    again = await store.finalize("batch_1", "completed")
    assert (first.output_file_id, first.error_file_id) == (
        again.output_file_id,
        again.error_file_id,
    )
    assert first.output_file_id is not None and first.error_file_id is not None
    assert await content(store, first.output_file_id) == '{"custom_id": "c0"}\n'
    assert await content(store, first.error_file_id) == '{"custom_id": "c1"}\n'
    assert again.status == "completed" and again.times["completed_at"] == 1000


@pytest.mark.parametrize(
    ("format_", "text", "expected"),
    [
        (None, "{}", "valid"),  # asked for no structure: an answer is enough
        ({"type": "json_object"}, '{"a": 1}', "valid"),
        ({"type": "json_object"}, "not json", "invalid"),
        ({"type": "json_schema", "json_schema": {"schema": {"required": ["a"]}}}, "{}", "invalid"),
        (
            {"type": "json_schema", "json_schema": {"schema": {"required": ["a"]}}},
            '{"a":1}',
            "valid",
        ),
    ],
)
async def test_structured_answers_are_checked(
    format_: dict[str, object] | None, text: str, expected: str
) -> None:
    asked = {"response_format": format_} if format_ else {}
    answer = {"choices": [{"message": {"content": text}}]}
    assert quality(asked, answer) == expected


async def test_files_round_trip_in_chunks_and_page_newest_first(store: BatchStore) -> None:
    data = bytes(range(256)) * (10 * 1024 + 7)  # 2.5 MiB: several chunks
    ids = []
    for name in ("a.jsonl", "b.jsonl"):
        spool = store.spool_path()
        await anyio.Path(spool).write_bytes(data)
        ids.append((await store.add_file("batch", name, spool)).id)
        assert not await anyio.Path(spool).exists()
    found = await store.get_file(ids[0])
    assert found is not None and (found.bytes, found.filename) == (len(data), "a.jsonl")
    assert b"".join([c async for c in store.read_file(ids[0])]) == data
    async with store.local_file(ids[1]) as path:
        assert await anyio.Path(path).read_bytes() == data
    assert [f.id for f in await store.list_files(None, 10)] == ids[::-1]
    assert [f.id for f in await store.list_files(ids[1], 10)] == ids[:1]
    assert await store.delete_file(ids[0]) and not await store.delete_file(ids[0])
    assert await store.get_file(ids[0]) is None


async def test_a_claimed_line_goes_to_one_owner_until_recorded_or_released(
    store: BatchStore,
) -> None:
    await new_job(store, 5)
    assert [p.idx for p in await store.claim("batch_1", "a", 2, 30)] == [1, 2]
    assert [p.idx for p in await store.claim("batch_1", "b", 10, 30)] == [3, 4, 5]
    assert await store.claim("batch_1", "a", 10, 30) == []
    assert await store.record("batch_1", 4, LineResult(True, "{}"))
    assert await store.release("batch_1", "b") == 2  # 3 and 5; 4 has its result
    assert [p.idx for p in await store.claim("batch_1", "a", 10, 30)] == [3, 5]
    assert await store.release("batch_1", "a") == 4
    claimed = await store.claim("batch_1", "b", 10, 30)
    assert [(p.idx, p.custom_id) for p in claimed] == [(1, "c0"), (2, "c1"), (3, "c2"), (5, "c4")]


async def test_a_lapsed_lease_is_claimed_again_a_renewed_one_is_not(store: BatchStore) -> None:
    await new_job(store, 4)
    assert len(await store.claim("batch_1", "kept", 2, 0.3)) == 2
    assert len(await store.claim("batch_1", "dead", 2, 0.3)) == 2
    assert await store.renew("batch_1", "kept", [1, 2, 3], 60) == 2  # 3 is not its own
    await anyio.sleep(0.6)  # twice the lease: "dead" never renewed
    assert [p.idx for p in await store.claim("batch_1", "next", 10, 30)] == [3, 4]
    assert await store.renew("batch_1", "dead", [3, 4], 30) == 0  # someone else's now
    assert await store.record("batch_1", 1, LineResult(True, "{}"))
    assert await store.renew("batch_1", "kept", [1, 2], 60) == 1  # 1 has its result


async def test_finalize_leaves_a_final_job_as_it_is(store: BatchStore) -> None:
    await new_job(store, 1)
    assert await store.set_status("batch_1", "cancelling", ("in_progress",))
    assert not await store.set_status("batch_1", "cancelling", ("in_progress",))
    done = await store.finalize("batch_1", "cancelled")
    again = await store.finalize("batch_1", "completed")
    assert (done.status, again.status) == ("cancelled", "cancelled")
    assert again.times.get("completed_at") is None
    assert [b.id for b in await store.active_batches()] == []
    assert await store.count_by_status() == {"cancelled": 1}


@pytest.mark.integration
async def test_postgres_replicas_starting_together_migrate_once(postgres_db: str) -> None:
    stores = [PostgresStore(postgres_db, lambda: 0.0, pool_size=2) for _ in range(3)]
    async with anyio.create_task_group() as group:
        for s in stores:
            group.start_soon(s.open)
    assert [await s.schema_version() for s in stores] == [len(MIGRATIONS)] * 3
    for s in stores:
        await s.close()


@pytest.mark.integration
async def test_postgres_schema_is_versioned(postgres_db: str) -> None:
    for _ in range(2):  # the second opens a database already at the newest version
        store = PostgresStore(postgres_db, lambda: 0.0, pool_size=2)
        await store.open()
        assert await store.schema_version() == len(MIGRATIONS)
        await store.close()
    with psycopg.connect(postgres_db, autocommit=True) as conn:
        conn.execute("UPDATE schema_version SET version = 99")
    with pytest.raises(RuntimeError, match="schema 99"):
        await PostgresStore(postgres_db, lambda: 0.0, pool_size=2).open()


@pytest.mark.integration
async def test_postgres_replicas_never_claim_one_line_twice(postgres_db: str) -> None:
    """Two stores (two pools, as two replicas have) claim at once until nothing is
    left: every line is handed out exactly once."""
    stores = [PostgresStore(postgres_db, lambda: 1000.0, pool_size=4) for _ in range(2)]
    for s in stores:
        await s.open()
    await new_job(stores[0], 300)
    got: dict[str, list[int]] = {"r0": [], "r1": []}

    async def take(store: BatchStore, owner: str) -> None:
        while page := await store.claim("batch_1", owner, 7, 30):
            got[owner].extend(p.idx for p in page)

    async with anyio.create_task_group() as group:
        for i, s in enumerate(stores):
            for _ in range(3):
                group.start_soon(take, s, f"r{i}")
    assert sorted(got["r0"] + got["r1"]) == list(range(1, 301))
    assert got["r0"] and got["r1"]
    results = []
    async with anyio.create_task_group() as group:  # both replicas finalize at once

        async def finalize(s: BatchStore) -> None:
            results.append(await s.finalize("batch_1", "completed"))

        for s in stores:
            group.start_soon(finalize, s)
    assert {(r.status, r.output_file_id) for r in results} == {("completed", "file-batch_1-output")}
    for s in stores:
        await s.close()


@pytest.mark.integration
async def test_postgres_store_logs_where_it_is_without_the_password(
    postgres_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    from psycopg.conninfo import make_conninfo

    dsn = make_conninfo(postgres_db, password="hunter2")  # trust auth: never asked for
    caplog.set_level("INFO", logger="proxy.batch.postgres")
    store = PostgresStore(dsn, lambda: 0.0, pool_size=2)
    await store.open()
    await store.close()
    assert "batch store: PostgreSQL at" in caplog.text and "migrated" in caplog.text
    assert "hunter2" not in caplog.text
