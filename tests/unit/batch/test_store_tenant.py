"""A batch job belongs to the tenant of the key that created it: the store keeps the
tenant's name on the job and gives it back on every read, on both backends; a
database made before tenants existed is migrated, its jobs anonymous ("")."""

from __future__ import annotations

import io
import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import psycopg
import pytest

from proxy.batch.lines import read_lines
from proxy.batch.postgres import MIGRATIONS, PostgresStore
from proxy.batch.sqlite import SCHEMA_VERSION, SQLiteStore
from proxy.batch.store import BatchStore, NewBatch

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.integration)]
PROGRESS_COLUMNS = ("busy_s", "busy_records", "busy_usable")  # schema 4
LEASE_COLUMNS = ("claimed_by", "lease_until")  # schema 5


def jsonl(n: int) -> bytes:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": body} for i in range(n)]
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def new_batch(batch_id: str, tenant: str = "") -> NewBatch:
    return NewBatch(batch_id, CHAT, "file-x", "24h", 86400, None, tenant=tenant)


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


async def test_the_tenant_is_stored_and_read_back_on_every_read(store: BatchStore) -> None:
    added = await store.add_batch(new_batch("batch_a", "team-a"))
    await store.add_batch(new_batch("batch_b", "team-b"))
    await store.add_batch(new_batch("batch_anon"))
    assert added.tenant == "team-a"
    filled = await store.fill_batch("batch_a", read_lines(io.BytesIO(jsonl(2)), CHAT, 10))
    assert (filled.status, filled.tenant) == ("in_progress", "team-a")
    got = await store.get_batch("batch_b")
    assert got is not None and got.tenant == "team-b"
    listed = {b.id: b.tenant for b in await store.list_batches(None, 10)}
    assert listed == {"batch_a": "team-a", "batch_b": "team-b", "batch_anon": ""}
    active = {b.id: b.tenant for b in await store.active_batches()}
    assert active == listed
    done = await store.finalize("batch_a", "completed")
    assert (done.status, done.tenant) == ("completed", "team-a")


async def test_a_version_2_sqlite_store_gains_the_column_its_jobs_anonymous(
    tmp_path: Path,
) -> None:
    old = SQLiteStore(tmp_path / "b.db", lambda: 1000.0)
    await old.open()
    await old.add_batch(new_batch("batch_old", "ignored"))
    await old.close()
    with sqlite3.connect(tmp_path / "b.db") as db:  # back to schema 2: no `tenant`
        for column in ("tenant", *PROGRESS_COLUMNS):
            db.execute(f"ALTER TABLE batches DROP COLUMN {column}")
        for column in LEASE_COLUMNS:  # schema 5's
            db.execute(f"ALTER TABLE lines DROP COLUMN {column}")
        db.execute("PRAGMA user_version = 2")
    store = SQLiteStore(tmp_path / "b.db", lambda: 1000.0)
    await store.open()
    with sqlite3.connect(tmp_path / "b.db") as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5
    old_job = await store.get_batch("batch_old")
    assert old_job is not None and old_job.tenant == ""
    new_job = await store.add_batch(new_batch("batch_new", "team-a"))
    assert new_job.tenant == "team-a"
    await store.close()


@pytest.mark.integration
async def test_a_version_2_postgres_store_gains_the_column_its_jobs_anonymous(
    postgres_db: str,
) -> None:
    old = PostgresStore(postgres_db, lambda: 1000.0, pool_size=2)
    await old.open()
    await old.add_batch(new_batch("batch_old", "ignored"))
    await old.close()
    with psycopg.connect(postgres_db, autocommit=True) as conn:  # back to schema 2
        for column in ("tenant", *PROGRESS_COLUMNS):
            conn.execute(f"ALTER TABLE batches DROP COLUMN {column}")
        conn.execute("UPDATE schema_version SET version = 2")
    store = PostgresStore(postgres_db, lambda: 1000.0, pool_size=2)
    await store.open()
    assert await store.schema_version() == len(MIGRATIONS) == 4
    old_job = await store.get_batch("batch_old")
    assert old_job is not None and old_job.tenant == ""
    new_job = await store.add_batch(new_batch("batch_new", "team-a"))
    assert new_job.tenant == "team-a"
    await store.close()
