"""A job's stored pace (schema 4), on both backends: increments that add up across
restarts and replicas, and a version-3 store migrated with its jobs kept."""

from __future__ import annotations

import io
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import psycopg
import pytest

from proxy.batch.lines import read_lines
from proxy.batch.postgres import MIGRATIONS, PostgresStore
from proxy.batch.sqlite import SCHEMA_VERSION, SQLiteStore
from proxy.batch.store import BatchStore, NewBatch, Progress
from tests.unit.batch.test_runner import CHAT, jsonl

pytestmark = pytest.mark.anyio
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.integration)]
COLUMNS = ("busy_s", "busy_records", "busy_usable")
LEASE_COLUMNS = ("claimed_by", "lease_until")  # schema 5


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BatchStore]:
    s: BatchStore
    if request.param == "sqlite":
        s = SQLiteStore(tmp_path / "b.db", lambda: 1000.0)
    else:
        s = PostgresStore(request.getfixturevalue("postgres_db"), lambda: 1000.0, pool_size=2)
    await s.open()
    yield s
    await s.close()


async def new_job(store: BatchStore, batch_id: str = "batch_1") -> None:
    await store.add_batch(NewBatch(batch_id, CHAT, "file-x", "24h", 86400, None))
    await store.fill_batch(batch_id, read_lines(io.BytesIO(jsonl(3)), CHAT, 1000))


async def test_progress_is_added_up_and_read_with_the_job(store: BatchStore) -> None:
    await new_job(store)
    await new_job(store, "batch_other")
    fresh = await store.get_batch("batch_1")
    assert fresh is not None and fresh.progress == Progress(0.0, 0, 0)
    await store.add_progress("batch_1", Progress(2.5, 4, 3))
    await store.add_progress("batch_1", Progress(1.25, 2, 2))  # another replica, or later
    batch = await store.get_batch("batch_1")
    assert batch is not None and batch.progress == Progress(3.75, 6, 5)
    assert [b.progress for b in await store.active_batches()] == [
        Progress(3.75, 6, 5),
        Progress(0.0, 0, 0),
    ]
    other = await store.get_batch("batch_other")
    assert other is not None and other.progress == Progress(0.0, 0, 0)


async def test_a_version_3_sqlite_store_gains_the_progress_columns(tmp_path: Path) -> None:
    old = SQLiteStore(tmp_path / "b.db", lambda: 1000.0)
    await old.open()
    await new_job(old)
    await old.close()
    with sqlite3.connect(tmp_path / "b.db") as db:  # back to schema 3
        for column in COLUMNS:
            db.execute(f"ALTER TABLE batches DROP COLUMN {column}")
        for column in LEASE_COLUMNS:  # schema 5's
            db.execute(f"ALTER TABLE lines DROP COLUMN {column}")
        db.execute("PRAGMA user_version = 3")
    store = SQLiteStore(tmp_path / "b.db", lambda: 1000.0)
    await store.open()
    with sqlite3.connect(tmp_path / "b.db") as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5
    kept = await store.get_batch("batch_1")
    assert kept is not None and (kept.total, kept.progress) == (3, Progress(0.0, 0, 0))
    await store.add_progress("batch_1", Progress(2.0, 8, 8))
    moved = await store.get_batch("batch_1")
    assert moved is not None and moved.progress == Progress(2.0, 8, 8)
    await store.close()


@pytest.mark.integration
async def test_a_version_3_postgres_store_gains_the_progress_columns(postgres_db: str) -> None:
    old = PostgresStore(postgres_db, lambda: 1000.0, pool_size=2)
    await old.open()
    await new_job(old)
    await old.close()
    with psycopg.connect(postgres_db, autocommit=True) as conn:  # back to schema 3
        for column in COLUMNS:
            conn.execute(f"ALTER TABLE batches DROP COLUMN {column}")
        conn.execute("UPDATE schema_version SET version = 3")
    store = PostgresStore(postgres_db, lambda: 1000.0, pool_size=2)
    await store.open()
    assert await store.schema_version() == len(MIGRATIONS) == 4
    kept = await store.get_batch("batch_1")
    assert kept is not None and (kept.total, kept.progress) == (3, Progress(0.0, 0, 0))
    await store.add_progress("batch_1", Progress(2.0, 8, 8))
    moved = await store.get_batch("batch_1")
    assert moved is not None and moved.progress == Progress(2.0, 8, 8)
    await store.close()
