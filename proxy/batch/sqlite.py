"""The SQLite batch store: one database file in WAL mode, file contents in a folder
beside it (``<path>.files/``). One connection, used from a worker thread under a
lock, so the event loop never waits on the disk. The schema is created at
:meth:`SQLiteStore.open` and versioned with ``PRAGMA user_version``.

Several processes may share the file (``serve --workers N`` on one box): the job
queue's leases are in the lines' rows (``claimed_by``, ``lease_until`` in epoch
seconds, the one clock of the box), taken in ``BEGIN IMMEDIATE`` transactions, so
a line is leased to one runner at a time, as on PostgreSQL; a job is filled once
(only while ``validating``), and it is finalized under the write lock from the
check of its status to the last write, so two processes never write its files at
once. A proxy that is the file's only user (``exclusive``) drops every lease when
it opens it: they were its own, from before a restart, and its lines run again at
once instead of after their lease.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from proxy.batch import store

T = TypeVar("T")
CHUNK_BYTES = 1 << 20
SCHEMA_VERSION = 5
SCHEMA = """
CREATE TABLE files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, deleted INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE batches (
    id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL, metadata TEXT, total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    valid INTEGER NOT NULL DEFAULT 0, invalid INTEGER NOT NULL DEFAULT 0,
    output_file_id TEXT, error_file_id TEXT, times TEXT NOT NULL DEFAULT '{}', errors TEXT,
    tenant TEXT NOT NULL DEFAULT '', busy_s REAL NOT NULL DEFAULT 0,
    busy_records INTEGER NOT NULL DEFAULT 0, busy_usable INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL,
    body TEXT NOT NULL, ok INTEGER, result TEXT, claimed_by TEXT, lease_until REAL,
    PRIMARY KEY (batch_id, idx), UNIQUE (batch_id, custom_id)
);
CREATE INDEX lines_pending ON lines (batch_id, idx) WHERE result IS NULL;
"""
# Each step moves a database from the version before it to the next one.
MIGRATIONS = {
    2: "ALTER TABLE batches ADD COLUMN errors TEXT;",
    3: "ALTER TABLE batches ADD COLUMN tenant TEXT NOT NULL DEFAULT '';",  # jobs before: anonymous
    4: (  # a job's measured pace (jobs before: nothing measured yet)
        "ALTER TABLE batches ADD COLUMN busy_s REAL NOT NULL DEFAULT 0; "
        "ALTER TABLE batches ADD COLUMN busy_records INTEGER NOT NULL DEFAULT 0; "
        "ALTER TABLE batches ADD COLUMN busy_usable INTEGER NOT NULL DEFAULT 0;"
    ),
    5: (  # the leases in the file, for several processes (before: in memory)
        "ALTER TABLE lines ADD COLUMN claimed_by TEXT; "
        "ALTER TABLE lines ADD COLUMN lease_until REAL;"
    ),
}
DROP_LEASES = "UPDATE lines SET claimed_by = NULL, lease_until = NULL WHERE claimed_by IS NOT NULL"
BATCH_COLUMNS = store.columns(store.BatchRecord)
FILE_COLUMNS = store.columns(store.FileRecord)


def _batch(row: Any) -> store.BatchRecord:
    meta = json.loads(row[7]) if row[7] else None
    return store.BatchRecord(
        id=row[0], endpoint=row[1], input_file_id=row[2], completion_window=row[3],
        status=row[4], created_at=row[5], expires_at=row[6], metadata=meta, total=row[8],
        completed=row[9], failed=row[10], valid=row[11], invalid=row[12],
        output_file_id=row[13], error_file_id=row[14], times=json.loads(row[15]),
        errors=json.loads(row[16]) if row[16] else None, tenant=row[17],
        busy_s=row[18], busy_records=row[19], busy_usable=row[20],
    )  # fmt: skip


def prepare(path: Path) -> None:
    """Create or migrate the store at ``path`` and drop its leases, as the file's
    only user: what the parent of several worker processes does before it starts
    them (so that they never race to migrate, and lines leased before a restart run
    again at once)."""
    SQLiteStore(path, lambda: 0.0)._open_sync().close()


class SQLiteStore:
    """:class:`~proxy.batch.store.BatchStore` on SQLite. ``now`` gives epoch seconds
    for the records' times; ``lease_clock`` the leases' (the box's wall clock, which
    every process sharing the file reads); ``exclusive``: this process is the file's
    only user."""

    def __init__(
        self,
        path: Path,
        now: Callable[[], float],
        *,
        exclusive: bool = True,
        lease_clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.files_dir = Path(f"{path}.files")
        self.exclusive = exclusive
        self._now = now
        self._lease_clock = lease_clock
        self._db: sqlite3.Connection | None = None
        self._lock = anyio.Lock()

    # -- plumbing -----------------------------------------------------------------

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        db = self._db
        assert db is not None, "store not open"
        async with self._lock:
            return await anyio.to_thread.run_sync(fn, db)

    def _open_sync(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.files_dir.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            db.executescript(f"BEGIN; {SCHEMA} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")
        elif version not in range(1, SCHEMA_VERSION + 1):
            db.close()
            raise RuntimeError(f"{self.path}: batch store schema {version} is not known")
        for step in range(version + 1, SCHEMA_VERSION + 1) if version else ():
            db.executescript(f"BEGIN; {MIGRATIONS[step]} PRAGMA user_version={step}; COMMIT;")
        if self.exclusive:
            db.execute(DROP_LEASES)
        return db

    async def open(self) -> None:
        self._db = await anyio.to_thread.run_sync(self._open_sync)

    async def close(self) -> None:
        if self._db is not None:
            db, self._db = self._db, None
            async with self._lock:
                await anyio.to_thread.run_sync(db.close)

    async def ping(self) -> None:
        """The database file and the files' folder are there (not under the lock: a
        long write holds it, and SQLite's own errors show an outage as they come)."""
        if self._db is None:
            raise sqlite3.OperationalError("store not open")
        for path in (self.path, self.files_dir):
            if not path.exists():
                raise sqlite3.OperationalError(f"{path} is gone")

    def _stamp(self) -> int:
        return int(self._now())

    # -- files --------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def spool_path(self) -> Path:
        return self.file_path(f"upload-{uuid.uuid4().hex}")

    async def read_file(self, file_id: str) -> AsyncIterator[bytes]:
        with self.file_path(file_id).open("rb") as f:
            while chunk := await anyio.to_thread.run_sync(f.read, CHUNK_BYTES):
                yield chunk

    @asynccontextmanager
    async def local_file(self, file_id: str) -> AsyncIterator[Path]:
        yield self.file_path(file_id)

    async def add_file(self, purpose: str, filename: str, source: Path) -> store.FileRecord:
        file_id, now = f"file-{uuid.uuid4().hex}", self._stamp()

        def add(db: sqlite3.Connection) -> store.FileRecord:
            record = store.FileRecord(file_id, purpose, filename, source.stat().st_size, now)
            os.replace(source, self.file_path(record.id))
            db.execute(
                f"INSERT INTO files ({FILE_COLUMNS}) VALUES (?, ?, ?, ?, ?)",
                (record.id, purpose, filename, record.bytes, record.created_at),
            )
            return record

        return await self._run(add)

    async def get_file(self, file_id: str) -> store.FileRecord | None:
        def get(db: sqlite3.Connection) -> Any:
            sql = f"SELECT {FILE_COLUMNS} FROM files WHERE id = ? AND deleted = 0"
            return db.execute(sql, (file_id,)).fetchone()

        row = await self._run(get)
        return store.FileRecord(*row) if row else None

    async def list_files(self, after: str | None, limit: int) -> list[store.FileRecord]:
        def rows(db: sqlite3.Connection) -> list[Any]:
            sql = f"SELECT {FILE_COLUMNS} FROM files WHERE deleted = 0"
            return db.execute(*_page(sql, after, limit)).fetchall()

        return [store.FileRecord(*row) for row in await self._run(rows)]

    async def delete_file(self, file_id: str) -> bool:
        def delete(db: sqlite3.Connection) -> bool:
            sql = "UPDATE files SET deleted = 1 WHERE id = ? AND deleted = 0"
            gone = db.execute(sql, (file_id,)).rowcount == 1
            if gone:
                self.file_path(file_id).unlink(missing_ok=True)
            return gone

        return await self._run(delete)

    # -- batches ------------------------------------------------------------------

    async def add_batch(self, new: store.NewBatch) -> store.BatchRecord:
        now = self._stamp()

        def add(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, "
                "status, created_at, expires_at, metadata, tenant) "
                "VALUES (?, ?, ?, ?, 'validating', ?, ?, ?, ?)",
                (new.id, new.endpoint, new.input_file_id, new.completion_window, now,
                 now + new.window_s, json.dumps(new.metadata) if new.metadata else None,
                 new.tenant),
            )  # fmt: skip

        await self._run(add)
        return await self._found(new.id)

    async def fill_batch(self, batch_id: str, lines: Iterator[store.LineSpec]) -> store.BatchRecord:
        def fill(db: sqlite3.Connection) -> None:
            with _tx(db):
                found = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,))
                if (found.fetchone() or ("",))[0] != "validating":
                    return  # another process filled it (or it was cancelled meanwhile)
                db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
                total = _insert_lines(db, batch_id, lines)
                db.execute(
                    "UPDATE batches SET total = ?, status = CASE status WHEN 'validating' "
                    "THEN 'in_progress' ELSE status END, times = json_set(times, "
                    "'$.in_progress_at', ?) WHERE id = ?",
                    (total, self._stamp(), batch_id),
                )

        await self._run(fill)
        return await self._found(batch_id)

    async def fail_batch(self, batch_id: str, errors: list[store.Json]) -> store.BatchRecord:
        def fail(db: sqlite3.Connection) -> None:
            db.execute(
                "UPDATE batches SET status = 'failed', errors = ?, "
                "times = json_set(times, '$.failed_at', ?) WHERE id = ?",
                (json.dumps(errors), self._stamp(), batch_id),
            )

        await self._run(fail)
        return await self._found(batch_id)

    async def expire_pending(
        self, batch_id: str, line_for: Callable[[str], store.LineResult]
    ) -> int:
        def expire(db: sqlite3.Connection) -> int:
            with _tx(db):
                sql = "SELECT idx, custom_id FROM lines WHERE batch_id = ? AND result IS NULL"
                rest = db.execute(sql, (batch_id,)).fetchall()
                for idx, custom_id in rest:
                    result = line_for(custom_id)
                    db.execute(
                        "UPDATE lines SET ok = ?, result = ? WHERE batch_id = ? AND idx = ?",
                        (int(result.ok), result.line, batch_id, idx),
                    )
                sql = "UPDATE batches SET failed = failed + ? WHERE id = ?"
                db.execute(sql, (len(rest), batch_id))
                return len(rest)

        return await self._run(expire)

    async def _found(self, batch_id: str) -> store.BatchRecord:
        found = await self.get_batch(batch_id)
        assert found is not None
        return found

    async def get_batch(self, batch_id: str) -> store.BatchRecord | None:
        def get(db: sqlite3.Connection) -> Any:
            sql = f"SELECT {BATCH_COLUMNS} FROM batches WHERE id = ?"
            return db.execute(sql, (batch_id,)).fetchone()

        row = await self._run(get)
        return _batch(row) if row else None

    async def list_batches(self, after: str | None, limit: int) -> list[store.BatchRecord]:
        def rows(db: sqlite3.Connection) -> list[Any]:
            sql = f"SELECT {BATCH_COLUMNS} FROM batches WHERE 1 = 1"
            return db.execute(*_page(sql, after, limit)).fetchall()

        return [_batch(row) for row in await self._run(rows)]

    async def active_batches(self) -> list[store.BatchRecord]:
        def rows(db: sqlite3.Connection) -> list[Any]:
            marks = ", ".join("?" for _ in store.ACTIVE)
            sql = f"SELECT {BATCH_COLUMNS} FROM batches WHERE status IN ({marks}) ORDER BY rowid"
            return db.execute(sql, store.ACTIVE).fetchall()

        return [_batch(row) for row in await self._run(rows)]

    async def set_status(self, batch_id: str, status: str, only_from: tuple[str, ...]) -> bool:
        now = self._stamp()

        def move(db: sqlite3.Connection) -> bool:
            marks = ", ".join("?" for _ in only_from)
            sql = (
                "UPDATE batches SET status = ?, times = json_set(times, ?, ?) "
                f"WHERE id = ? AND status IN ({marks})"
            )
            args = (status, f"$.{status}_at", now, batch_id, *only_from)
            return db.execute(sql, args).rowcount == 1

        return await self._run(move)

    async def count_by_status(self) -> dict[str, int]:
        def rows(db: sqlite3.Connection) -> list[Any]:
            return db.execute("SELECT status, COUNT(*) FROM batches GROUP BY status").fetchall()

        return dict(await self._run(rows))

    # -- lines --------------------------------------------------------------------

    async def claim(
        self, batch_id: str, owner: str, limit: int, lease_s: float
    ) -> list[store.PendingLine]:
        def claim(db: sqlite3.Connection) -> list[Any]:
            now = self._lease_clock()
            with _tx(db):
                sql = (
                    "UPDATE lines SET claimed_by = ?, lease_until = ? WHERE batch_id = ? "
                    "AND idx IN (SELECT idx FROM lines WHERE batch_id = ? AND result IS NULL "
                    "AND (lease_until IS NULL OR lease_until < ?) ORDER BY idx LIMIT ?) "
                    "RETURNING idx, custom_id, body"
                )
                args = (owner, now + lease_s, batch_id, batch_id, now, limit)
                return db.execute(sql, args).fetchall()

        rows = sorted(await self._run(claim))
        return [store.PendingLine(i, c, json.loads(b)) for i, c, b in rows]

    async def renew(self, batch_id: str, owner: str, lines: Sequence[int], lease_s: float) -> int:
        def renew(db: sqlite3.Connection) -> int:
            until, renewed = self._lease_clock() + lease_s, 0
            sql = (
                "UPDATE lines SET lease_until = ? WHERE batch_id = ? AND idx = ? "
                "AND claimed_by = ? AND result IS NULL"
            )
            with _tx(db):
                for idx in lines:
                    renewed += db.execute(sql, (until, batch_id, idx, owner)).rowcount
            return renewed

        return await self._run(renew)

    async def release(self, batch_id: str, owner: str) -> int:
        def release(db: sqlite3.Connection) -> int:
            sql = (
                "UPDATE lines SET claimed_by = NULL, lease_until = NULL "
                "WHERE batch_id = ? AND claimed_by = ? AND result IS NULL"
            )
            return db.execute(sql, (batch_id, owner)).rowcount

        return await self._run(release)

    async def record(self, batch_id: str, idx: int, result: store.LineResult) -> bool:
        def record(db: sqlite3.Connection) -> bool:
            with _tx(db):
                sql = "UPDATE lines SET ok = ?, result = ? WHERE batch_id = ? AND idx = ? "
                sql += "AND result IS NULL"
                if db.execute(sql, (int(result.ok), result.line, batch_id, idx)).rowcount != 1:
                    return False
                count = "completed" if result.ok else "failed"
                extra = f", {result.quality} = {result.quality} + 1" if result.quality else ""
                sql = f"UPDATE batches SET {count} = {count} + 1{extra} WHERE id = ?"
                db.execute(sql, (batch_id,))
                return True

        return await self._run(record)

    async def add_progress(self, batch_id: str, progress: store.Progress) -> None:
        def add(db: sqlite3.Connection) -> None:
            db.execute(
                "UPDATE batches SET busy_s = busy_s + ?, busy_records = busy_records + ?, "
                "busy_usable = busy_usable + ? WHERE id = ?",
                (progress.busy_s, progress.records, progress.usable, batch_id),
            )

        await self._run(add)

    async def finalize(self, batch_id: str, status: str) -> store.BatchRecord:
        now = self._stamp()
        out_id, err_id = f"file-{batch_id}-output", f"file-{batch_id}-errors"

        def finalize(db: sqlite3.Connection) -> None:
            with _tx(db):  # the write lock from the check on: one process finalizes
                row = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,))
                found = row.fetchone()
                if found is None or found[0] in store.FINAL:
                    return
                sizes = self._write_results(db, batch_id, out_id, err_id)
                for file_id, size in zip((out_id, err_id), sizes, strict=True):
                    db.execute(
                        f"INSERT OR REPLACE INTO files ({FILE_COLUMNS}) VALUES (?, ?, ?, ?, ?)",
                        (file_id, "batch_output", f"{file_id}.jsonl", size, now),
                    )
                db.execute(
                    "UPDATE batches SET status = ?, output_file_id = ?, error_file_id = ?, "
                    "times = json_set(times, ?, ?) WHERE id = ?",
                    (status, out_id, err_id, f"$.{status}_at", now, batch_id),
                )

        await self._run(finalize)
        found = await self.get_batch(batch_id)
        assert found is not None
        return found

    def _write_results(
        self, db: sqlite3.Connection, batch_id: str, out_id: str, err_id: str
    ) -> tuple[int, int]:
        """Stream the recorded lines into the two files (written whole, then renamed)."""
        paths = [self.file_path(out_id), self.file_path(err_id)]
        temps = [p.with_suffix(".tmp") for p in paths]  # written under the write lock
        with temps[0].open("w") as out, temps[1].open("w") as err:
            sql = "SELECT ok, result FROM lines WHERE batch_id = ? AND result IS NOT NULL "
            for ok, line in db.execute(sql + "ORDER BY idx", (batch_id,)):
                (out if ok else err).write(line + "\n")
            for f in (out, err):
                f.flush()
                os.fsync(f.fileno())
        for temp, path in zip(temps, paths, strict=True):
            os.replace(temp, path)
        return paths[0].stat().st_size, paths[1].stat().st_size


class _tx:
    """``BEGIN IMMEDIATE`` … ``COMMIT``, or ``ROLLBACK`` when the block raises."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        if not self.db.in_transaction:
            self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: object, *_: object) -> None:
        if not self.db.in_transaction:
            return
        self.db.execute("ROLLBACK" if kind is not None else "COMMIT")


def _insert_lines(db: sqlite3.Connection, batch_id: str, lines: Iterator[store.LineSpec]) -> int:
    total = 0
    for line in lines:
        try:
            db.execute(
                "INSERT INTO lines (batch_id, idx, custom_id, body) VALUES (?, ?, ?, ?)",
                (batch_id, line.idx, line.custom_id, line.body),
            )
        except sqlite3.IntegrityError:
            raise store.LineError(line.idx, f"duplicate custom_id `{line.custom_id}`") from None
        total += 1
    if total == 0:
        raise store.LineError(0, "The input file has no requests.")
    return total


def _page(sql: str, after: str | None, limit: int) -> tuple[str, tuple[Any, ...]]:
    """Newest first, starting after the row ``after`` names."""
    if after is None:
        return sql + " ORDER BY rowid DESC LIMIT ?", (limit,)
    sql += " AND rowid < (SELECT rowid FROM {t} WHERE id = ?) ORDER BY rowid DESC LIMIT ?"
    table = "files" if "FROM files" in sql else "batches"
    return sql.replace("{t}", table), (after, limit)
